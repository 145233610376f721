"""The management API of a live async run, over real HTTP on loopback: auth, scaling, checkpoint,
stop, and a schema-driven fuzz (schemathesis) that must never get a 5xx."""

from __future__ import annotations

import json
import stat
import threading
import time
from pathlib import Path

import requests
import schemathesis
from hypothesis import HealthCheck, given, settings

from rlx.obs.metrics import read_metrics
from rlx.orchestration.async_run import run_async
from tests.integration.test_colocate_loop import toy_config


def wait_for(predicate, timeout: float = 300.0, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (OSError, ValueError, requests.RequestException):  # the run is still starting
            value = None
        if value:
            return value
        time.sleep(every)
    raise TimeoutError("condition not met in time")


def fuzz_without_token(url: str) -> None:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=schema.as_strategy())
    def no_server_errors(case):
        response = case.call(base_url=url)
        assert response.status_code < 500, (case.method, case.path, response.text)
        if case.method == "POST":  # mutating calls without the run's token never get through
            assert response.status_code in (401, 403, 422), (case.path, response.status_code)

    no_server_errors()


def drive(run_dir: Path, seen: dict) -> None:
    url = wait_for(lambda: (run_dir / "api.json").exists() and json.loads((run_dir / "api.json").read_text())["url"])
    token_file = run_dir / "api_token"
    seen["token_mode"] = stat.S_IMODE(token_file.stat().st_mode)
    auth = {"Authorization": f"Bearer {token_file.read_text()}"}
    status = lambda: requests.get(f"{url}/v1/status", timeout=30).json()  # noqa: E731
    engines = lambda: requests.get(f"{url}/v1/rollout/engines", timeout=30).json()  # noqa: E731
    wait_for(lambda: status()["step"] >= 2)

    seen["no_token"] = requests.post(f"{url}/v1/rollout/scale", json={"replicas": 2}, timeout=30).status_code
    seen["wrong_token"] = requests.post(f"{url}/v1/rollout/scale", json={"replicas": 2}, timeout=30,
                                        headers={"Authorization": "Bearer nope"}).status_code
    seen["bad_body"] = requests.post(f"{url}/v1/rollout/scale", json={"replicas": 0}, headers=auth,
                                     timeout=30).status_code
    seen["up"] = requests.post(f"{url}/v1/rollout/scale", json={"replicas": 2}, headers=auth, timeout=600).json()
    seen["step_at_2"] = status()["step"]
    seen["engines_at_2"] = wait_for(lambda: len(engines()) == 2 and engines())
    wait_for(lambda: status()["step"] >= seen["step_at_2"] + 3)
    seen["down"] = requests.post(f"{url}/v1/rollout/scale", json={"replicas": 1}, headers=auth, timeout=600).json()
    seen["step_at_1"] = status()["step"]
    wait_for(lambda: len(engines()) == 1)
    seen["checkpoint"] = requests.post(f"{url}/v1/checkpoint", headers=auth, timeout=600).json()["path"]
    fuzz_without_token(url)
    seen["stop"] = requests.post(f"{url}/v1/stop", headers=auth, timeout=30).status_code


def test_api_scales_rollout_and_guards_every_mutation(tiny_path, tmp_path):
    # far more steps than the test lasts: the run ends through /v1/stop (the budget is only a safety net)
    config = toy_config(tiny_path, tmp_path, train__steps=100_000, train__mode="async", train__max_staleness=1,
                        rollout__prompts_per_step=2, rollout__max_batch_size=16, train__time_budget_s=900)
    run_dir = Path(config.logging.run_dir)
    seen: dict = {}
    errors: list[BaseException] = []

    def driver():
        try:
            drive(run_dir, seen)
        except BaseException as exc:  # surfaced below; the run still has to be stopped
            errors.append(exc)
            url = wait_for(lambda: json.loads((run_dir / "api.json").read_text())["url"])
            token = (run_dir / "api_token").read_text()
            requests.post(f"{url}/v1/stop", headers={"Authorization": f"Bearer {token}"}, timeout=30)

    thread = threading.Thread(target=driver, daemon=True)
    thread.start()
    run_async(config, echo=print)
    thread.join(timeout=60)
    assert not errors, errors
    assert seen["token_mode"] == 0o600
    assert seen["no_token"] == 401 and seen["wrong_token"] == 401 and seen["bad_body"] == 422
    assert seen["up"] == {"replicas_before": 1, "replicas": 2}
    assert len({e["replica"] for e in seen["engines_at_2"]}) == 2
    assert seen["down"] == {"replicas_before": 2, "replicas": 1}
    assert Path(seen["checkpoint"], "model.safetensors").exists()
    assert seen["stop"] == 200
    steps = [r for r in read_metrics(run_dir) if "trained_samples" in r]
    assert len(steps) >= 5
    assert steps[-1]["total_samples_duplicated"] == 0  # scale-in and scale-out lost and repeated nothing
    rate = lambda a, b: (b - a) * 16 / (steps[b - 1]["wall_time_s"] - steps[a - 1]["wall_time_s"])  # noqa: E731
    print(f"samples/s with 1 replica: {rate(1, seen['step_at_2']):.2f}; "
          f"with 2: {rate(seen['step_at_2'], seen['step_at_1']):.2f}")
