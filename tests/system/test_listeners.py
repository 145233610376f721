"""Every socket an async run listens on (N2): while a real run trains (its roles as Serve replicas, the
Actor over a 2-rank group, weights over a gloo broadcast, the management API), every process of
the run is listed (the driver and all it started: Ray's GCS, raylet, agents and workers, the
Serve controller and replicas, the rank processes) with every socket it listens on. Each must be
bound to loopback only, or answer a call without Ray's token with an authentication error, or be
on `ALLOWED` below with the process, its purpose and why it is safe. The inventory is printed."""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
import time
from dataclasses import dataclass

import grpc
import psutil
import pytest

from rlx.orchestration.async_run import run_async
from tests.integration.test_colocate_loop import toy_config

# (process name part, purpose, why it is safe) of a listener that is neither loopback-only nor
# authenticated. Empty: on Ray >= 2.60 nothing of a run needs it. docs/security.md repeats it.
ALLOWED: list[tuple[str, str, str]] = []


@dataclass(frozen=True)
class Listener:
    pid: int
    process: str
    kind: str  # tcp or udp
    ip: str
    port: int


def loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def run_listeners(root: psutil.Process) -> list[Listener]:
    """Every listening TCP socket and every bound, unconnected UDP socket of `root` and all it started."""
    found = set()
    for process in [root, *root.children(recursive=True)]:
        try:
            name = " ".join(process.cmdline())[:90] or process.name()
            for c in process.net_connections("inet"):
                tcp = c.type == 1  # SOCK_STREAM
                if (tcp and c.status == psutil.CONN_LISTEN) or (not tcp and not c.raddr):
                    found.add(Listener(process.pid, name, "tcp" if tcp else "udp", c.laddr.ip, c.laddr.port))
        except psutil.Error:  # ended meanwhile
            continue
    return sorted(found, key=lambda x: (x.process, x.port))


def refuses_without_token(port: int) -> str | None:
    """A gRPC call without Ray's token: the status it got (UNAUTHENTICATED is what an authenticated
    Ray server answers), or None when nothing gRPC answered."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/ray.serve.ASGIService/HandleRequest")
        try:
            call(b"", timeout=3)
        except grpc.RpcError as error:
            return error.code().name
    return "OK"


def judge(listener: Listener) -> str:
    if loopback(listener.ip):
        return "loopback"
    allowed = [a for a in ALLOWED if a[0] in listener.process]
    if allowed:
        return f"allowed: {allowed[0][1]} ({allowed[0][2]})"
    if listener.kind == "tcp" and refuses_without_token(listener.port) == "UNAUTHENTICATED":
        return "refuses a call without Ray's token (UNAUTHENTICATED)"
    return "EXPOSED"


def test_a_listener_on_every_interface_that_takes_calls_without_a_token_is_exposed():
    with socket.create_server(("0.0.0.0", 0)) as open_port, socket.create_server(("127.0.0.1", 0)) as local:
        listeners = {x.port: x for x in run_listeners(psutil.Process())}
        assert judge(listeners[local.getsockname()[1]]) == "loopback"
        assert judge(listeners[open_port.getsockname()[1]]) == "EXPOSED"


@pytest.mark.slow
def test_every_socket_of_a_run_is_loopback_or_authenticated(tiny_path, tmp_path):
    config = toy_config(tiny_path, tmp_path, train__steps=3, train__mode="async", weights__channel="gloo",
                        resources__actor={"ranks": 2, "num_cpus": 0.5}, train__time_budget_s=600)
    metrics = tmp_path / "run" / "metrics.jsonl"
    seen: dict = {}

    def inventory() -> None:
        """Once the run has trained a step (every role up, the rank group and the weight group formed)."""
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and "listeners" not in seen:
            steps = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
            if any("loss" in r for r in steps):
                listeners = run_listeners(psutil.Process())
                seen["listeners"] = [(x, judge(x)) for x in listeners]
            time.sleep(0.5)

    watcher = threading.Thread(target=inventory, daemon=True)
    watcher.start()
    run_async(config, echo=lambda _: None)
    watcher.join(timeout=60)
    assert "listeners" in seen, "the run ended before the inventory was taken"
    print(f"\n{len(seen['listeners'])} listening sockets of the run:")
    for x, verdict in seen["listeners"]:
        print(f"  {x.kind} {x.ip}:{x.port:<6} pid {x.pid:<7} {x.process[:70]:<70} {verdict}")
    processes = " ".join(x.process for x, _ in seen["listeners"])
    for part in ("gcs_server", "raylet", "ServeReplica", "RankProcess"):  # the inventory saw the whole run
        assert part in processes, part
    assert any(v.startswith("refuses") for _, v in seen["listeners"])  # the replicas' gRPC ports were called
    exposed = [x for x, verdict in seen["listeners"] if verdict == "EXPOSED"]
    assert not exposed, exposed
