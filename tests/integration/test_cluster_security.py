"""What is reachable on a started cluster: Ray refuses a client without the cluster's token, the token
file is the owner's alone, rlx refuses to join a cluster without authentication, and the weight
channel's rendezvous listens on loopback only. Scaling on that cluster: a scale it cannot place is
refused up front, and one whose replicas do not start in time is undone."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import ray
from ray import serve

from rlx.config import ConfigError
from rlx.orchestration.api import ScaleRefused, ScaleTimedOut
from rlx.orchestration.cluster import ensure_token_file, ray_temp_dir, require_token_auth, start_ray, stop_ray
from rlx.orchestration.rank_group import RankGroup
from rlx.orchestration.scaling import redeploy, require_placeable, running_replicas
from rlx.weights.broadcast import HOST_ENV, rendezvous_host, serve_store

CONNECT = ("import sys; from ray._raylet import GcsClient; "
           "GcsClient(address=sys.argv[1]).internal_kv_keys(b'', None, timeout=10); print('connected')")


def gcs_client(address: str, **env: str) -> subprocess.CompletedProcess:
    """A fresh process that talks to the GCS with the given auth settings."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    return subprocess.run([sys.executable, "-c", CONNECT, address], check=False, env={**base, **env},
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def token_cluster(tmp_path_factory):
    """A local cluster started by rlx, with its token file in a temporary folder."""
    if ray.is_initialized():
        pytest.skip("needs a cluster of its own; another test's cluster is still up in this process")
    token_path = tmp_path_factory.mktemp("ray") / "auth_token"
    with pytest.MonkeyPatch.context() as patch:  # what start_ray sets is undone afterwards
        for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE", HOST_ENV):
            patch.delenv(name, raising=False)
        patch.setenv("RAY_AUTH_TOKEN_PATH", str(token_path))
        start_ray(num_cpus=1)
        yield ray.get_runtime_context().gcs_address, token_path
        stop_ray()


def test_a_local_cluster_refuses_clients_without_its_token(token_cluster):
    address, token_path = token_cluster
    assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
    wrong = gcs_client(address, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="not-the-token")
    assert wrong.returncode != 0 and "Authentication token is missing or incorrect" in wrong.stderr
    without = gcs_client(address, RAY_AUTH_MODE="disabled")
    assert without.returncode != 0 and "Authentication token is missing or incorrect" in without.stderr
    right = gcs_client(address, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_path))
    assert right.returncode == 0 and "connected" in right.stdout, right.stderr
    require_token_auth(address)  # rlx would join this one


JOIN = ("import sys; import ray; from rlx.orchestration.cluster import start_ray; start_ray(address=sys.argv[1]); "
        "print('joined', ray.cluster_resources()['CPU'])")


def test_a_driver_joins_a_token_cluster_with_the_token_it_is_given(token_cluster, tmp_path):
    address, token_path = token_cluster
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}  # no token mode set by hand
    joined = subprocess.run([sys.executable, "-c", JOIN, address], check=False, capture_output=True, text=True,
                            env={**base, "RAY_AUTH_TOKEN_PATH": str(token_path)}, timeout=180)
    assert joined.returncode == 0 and "joined" in joined.stdout, joined.stderr[-2000:]
    tokenless = subprocess.run([sys.executable, "-c", JOIN, address], check=False, capture_output=True, text=True,
                               env={**base, "HOME": str(tmp_path), "RAY_AUTH_TOKEN_PATH": str(tmp_path / "none")},
                               timeout=180)
    assert tokenless.returncode != 0 and "requires a token and this machine has none" in tokenless.stderr


def test_an_existing_token_file_is_made_owner_only(tmp_path):
    path = tmp_path / "auth_token"
    path.write_text("kept")
    path.chmod(0o644)
    ensure_token_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == "kept"


def test_joining_a_cluster_without_authentication_is_refused(tmp_path):
    # a second, unauthenticated cluster in its own process; it shuts down when its stdin closes
    script = ("import ray, sys; ray.init(address='local', num_cpus=0, include_dashboard=False, "
              "_node_ip_address='127.0.0.1'); print(ray.get_runtime_context().gcs_address, flush=True); "
              "sys.stdin.read(); ray.shutdown()")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | {"RAY_AUTH_MODE": "disabled"}
    with subprocess.Popen([sys.executable, "-c", script], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True, cwd=tmp_path) as open_cluster:
        try:
            address = open_cluster.stdout.readline().strip()
            assert address, "the unauthenticated cluster did not start"
            with pytest.raises(ConfigError, match="accepts clients without a token") as refused:
                require_token_auth(address)
            assert "resources.ray_allow_unauthenticated=true" in str(refused.value)
            assert "RAY_AUTH_TOKEN" in str(refused.value)
        finally:
            open_cluster.stdin.close()
            open_cluster.wait(timeout=60)


def test_a_ray_client_address_is_refused_unless_allowed():
    with pytest.raises(ConfigError, match="cannot check that a Ray Client endpoint requires a token"):
        require_token_auth("ray://10.0.0.1:10001")


def non_loopback_address() -> str | None:
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address
    return None


def test_the_weight_rendezvous_listens_on_loopback_only(monkeypatch):
    monkeypatch.setenv(HOST_ENV, "127.0.0.1")
    store = serve_store(rendezvous_host(), timeout_s=5)
    listening = {c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN
                 and c.laddr.port == store.port}
    assert listening == {"127.0.0.1"}
    other = non_loopback_address()
    if other is not None:  # another interface of this machine does not reach it
        with pytest.raises(OSError):
            socket.create_connection((other, store.port), timeout=2).close()


def listeners_on(port: int) -> set[str]:
    """The addresses any process of this machine listens on at `port`."""
    return {c.laddr.ip for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_a_rank_groups_rendezvous_listens_on_loopback_only(token_cluster):
    group = RankGroup(lambda: "role", ranks=2, num_cpus=0.5, num_gpus=0, threads=1, name="actor")
    try:
        host, port = group.address
        assert host == "127.0.0.1" and listeners_on(port) == {"127.0.0.1"}
        assert group._all("__len__") == [4, 4]  # both ranks joined the group and built their role
    finally:
        group.close()
        deadline = time.monotonic() + 60  # Ray frees the group's placement a moment later; the tests
        while ray.available_resources().get("CPU", 0.0) < 1.0 and time.monotonic() < deadline:  # after need it
            time.sleep(0.2)


def test_ray_keeps_its_session_files_in_a_directory_of_this_user_alone(token_cluster):
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    assert session.parent == ray_temp_dir() and stat.S_IMODE(session.parent.stat().st_mode) == 0o700


def test_an_unresolvable_rendezvous_host_names_the_setting():
    with pytest.raises(ValueError, match=r"weight-channel host 'no-such-host\.invalid' does not resolve.*"
                                         r"RLX_WEIGHTS_HOST"):
        serve_store("no-such-host.invalid", timeout_s=5)


def test_a_scale_beyond_the_free_resources_is_refused_with_the_reason(token_cluster):
    with pytest.raises(ScaleRefused, match=r"2 more rollout replica\(s\) need 4 CPU \(2 each\) but the cluster has "
                                           r"[\d.]+ CPU free of 1; scale to fewer, lower resources.rollout.num_cpus"):
        require_placeable("rollout", {"CPU": 2.0, "GPU": 0.0}, 2)
    with pytest.raises(ScaleRefused, match="need 1 GPU"):
        require_placeable("rollout", {"CPU": 0.0, "GPU": 1.0}, 1)
    require_placeable("rollout", {"CPU": 0.5, "GPU": 0.0}, 1)  # fits: no error
    require_placeable("rollout", {"CPU": 8.0, "GPU": 0.0}, -1)  # scaling in always fits


@serve.deployment
class Echo:
    def __call__(self, value: int) -> int:
        return value


def echo_app(replicas: int) -> serve.RunTarget:
    app = Echo.options(num_replicas=replicas, ray_actor_options={"num_cpus": 0.5}).bind()
    return serve.RunTarget(app, name="echo", route_prefix=None)


def test_a_scale_whose_replicas_do_not_start_in_time_is_undone(token_cluster):
    serve.start(proxy_location="Disabled")
    try:
        handle = redeploy(echo_app(1), 1, echo_app(1), timeout_s=120)
        assert handle.remote(3).result(timeout_s=60) == 3
        # 3 replicas of 0.5 CPU on a 1-CPU cluster: the third never starts
        with pytest.raises(ScaleTimedOut, match=r"echo: 3 replica\(s\) did not all start within 3s .*"
                                                r"the previous replicas were put back"):
            redeploy(echo_app(3), 3, echo_app(1), timeout_s=3)
        assert running_replicas("echo") == 1
        assert handle.remote(4).result(timeout_s=60) == 4
    finally:
        serve.shutdown()
