"""The python tool's sandbox against hostile code: each attack is stopped or refused with a clear
observation, nothing it started survives the call, and this process carries on.

Real processes throughout. Limits are small so the file stays fast: 2 s of CPU, 2 s of wall clock
where the test is about the wall clock (elsewhere 20 s, so a loaded machine cannot make a trivial
program time out). The sandbox fails closed, so this file asserts that the platform isolates it
(never skips), as this user and, from a root host, as an unprivileged one
(`test_the_sandbox_holds_for_an_unprivileged_host_user`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from rlx.agents import sandbox
from rlx.agents.sandbox import SWITCH, SandboxCapabilities, sandbox_capabilities
from rlx.agents.tools import ToolBox, build_tool
from rlx.cli import main
from rlx.config import load_config
from rlx.errors import ConfigError
from rlx.isolation import _RLX_ROOT, CONFINE_SOURCE, confinement, interpreter_paths

CAPS = sandbox_capabilities()


def python_box(**limits) -> ToolBox:
    options = {"timeout_s": 20, "cpu_s": 2, "memory_mb": 256, "max_file_mb": 4, "disk_mb": 16, **limits}
    return ToolBox([build_tool("python", options)], max_output_chars=4000)


def survivors(marker: str) -> list[psutil.Process]:
    """Processes whose command line holds `marker` (the code travels in argv, and forks keep it)."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if marker in cmdline and process.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(process)
    return found


def run(code: str, **limits):
    """Run `code` with a unique marker and check that nothing it started is left afterwards."""
    marker = f"rlx-sandbox-test-{uuid.uuid4().hex}"
    result = python_box(**limits).call("python", {"code": f"# {marker}\n{code}"})
    assert survivors(marker) == [], f"processes outlived the call: {survivors(marker)}"
    return result


def test_normal_code_prints_its_result():
    result = run("print(sum(range(10)))\nprint('done')")
    assert (result.outcome, result.text) == ("ok", "45\ndone\n[exit code 0]")


def test_a_failing_program_shows_its_traceback_and_exit_code():
    result = run("import sys\nprint('before')\nsys.exit(3)")
    assert (result.outcome, result.text) == ("error", "before\n[exit code 3]")
    result = run("1 / 0")
    assert result.outcome == "error"
    assert "ZeroDivisionError: division by zero" in result.text and result.text.endswith("[exit code 1]")


def test_working_directory_is_empty_private_and_removed():
    code = "import os\nprint(os.getcwd())\nprint(os.listdir('.'))\nopen('left.txt', 'w').write('x')"
    first, second = run(code), run(code)
    first_dir, listing = first.text.splitlines()[:2]
    assert first.outcome == "ok" and listing == "[]"
    assert second.text.splitlines()[1] == "[]"  # the file the first call wrote is not there
    assert first_dir != second.text.splitlines()[0]
    assert not os.path.exists(first_dir)


@pytest.mark.skipif(os.geteuid() != 0, reason="only a root host drops the code to another user")
def test_code_does_not_run_as_root():
    assert CAPS.unprivileged_user
    result = run("import os\nprint(os.getuid(), os.geteuid())")
    assert result.outcome == "ok"
    assert "0" not in result.text.splitlines()[0].split()


@pytest.mark.skipif(os.geteuid() != 0, reason="the user option applies on a root host only")
def test_an_unknown_user_is_a_config_error():
    with pytest.raises(ConfigError, match="rollout.agent.tools: python tool option user='no-such-user-x'"):
        build_tool("python", {"user": "no-such-user-x"})


def test_infinite_cpu_loop_is_killed_by_the_cpu_limit():
    result = run("print('spinning')\nwhile True:\n    pass", cpu_s=1, timeout_s=60)  # wall clock far off
    assert result.outcome == "error"
    assert result.text.startswith("spinning\n")
    assert "[killed by signal 24 (CPU time limit exceeded): the CPU time limit]" in result.text


def test_infinite_wait_is_stopped_at_the_wall_clock_limit():
    result = run("import time\nprint('started')\nwhile True:\n    time.sleep(1)", timeout_s=2)
    assert result.outcome == "timeout"
    assert result.text.startswith("started\n")  # output before the kill is kept (unbuffered)
    assert "[stopped at the wall-clock limit of 2 s; its processes were killed]" in result.text
    assert result.latency_s < 30  # generous upper bound on the deadline


def test_allocating_10_gb_fails_with_memory_error():
    result = run("x = bytearray(10 * 1024 ** 3)\nprint('allocated')")
    assert result.outcome == "error"
    assert "MemoryError" in result.text and "allocated" not in result.text


def test_a_huge_file_is_refused_at_the_file_size_limit():
    code = "with open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'x' * 1024 * 1024)"
    result = run(code)
    assert result.outcome == "error"
    assert "File too large" in result.text


def test_many_files_are_refused_at_the_disk_limit():
    code = ("for i in range(100):\n"
            "    with open(f'part{i}', 'wb') as f:\n"
            "        f.write(b'x' * 3 * 1024 * 1024)")  # each under the 4 MB file limit, 300 MB in all
    result = run(code)
    assert result.outcome == "error"
    assert "No space left on device" in result.text


def test_a_fork_bomb_is_stopped_and_leaves_nothing():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = run(code, timeout_s=2)
    assert result.outcome == "timeout"
    assert subprocess.run(["true"], check=False).returncode == 0  # this process can still start processes


def test_a_detached_child_does_not_outlive_the_call():
    code = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            "        time.sleep(300)\n"
            "    os._exit(0)\n"
            "print('parent done')")
    result = run(code)  # run() asserts that the double-forked, setsid sleeper is gone
    assert (result.outcome, result.text) == ("ok", "parent done\n[exit code 0]")


def test_connecting_to_the_host_loopback_fails():
    accepted = []
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        port = server.getsockname()[1]
        result = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')")
        try:
            accepted.append(server.accept())
        except TimeoutError:
            pass
    assert result.outcome == "error"
    assert "Network is unreachable" in result.text and "connected\n" not in result.text
    assert accepted == []


def test_connecting_out_and_resolving_names_fail():
    result = run("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)")
    assert result.outcome == "error" and "Network is unreachable" in result.text
    result = run("import socket\nsocket.getaddrinfo('example.com', 80)")
    assert result.outcome == "error" and "gaierror" in result.text


def test_host_files_of_other_users_stay_unreadable(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("token")
    secret.chmod(0o600)
    result = run(f"print(open({str(secret)!r}).read())")
    assert result.outcome == "error"
    assert "token" not in result.text
    assert "PermissionError" in result.text or "FileNotFoundError" in result.text


def test_the_code_cannot_forge_the_sandbox_report():
    code = ("import os\n"
            "for fd in range(3, 64):\n"
            "    try:\n"
            "        os.write(fd, b'{\"exit\": 0}\\n')\n"
            "    except OSError:\n"
            "        pass\n"
            "raise SystemExit(5)")
    assert run(code).text.endswith("[exit code 5]")


def test_output_is_bounded():
    result = run("print('a' * 2_000_000)\nprint('end')")
    assert result.outcome == "ok"
    assert len(result.text) <= 4000 and "truncated" in result.text
    assert result.text.endswith("end\n[exit code 0]")


def test_sandboxes_run_concurrently_from_threads():
    box = python_box()
    code = "import sys\nprint(int(sys.argv[0] == '-c'), {i} * 7)"
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: box.call("python", {"code": code.format(i=i)}), range(8)))
    assert [(r.outcome, r.text) for r in results] == [("ok", f"1 {i * 7}\n[exit code 0]") for i in range(8)]
    assert threading.active_count() < 50


def test_isolation_is_granted_here():
    """The sandbox fails closed, so a platform without it would refuse the tool: this one must not."""
    assert CAPS.isolated, CAPS.why
    assert CAPS.unprivileged_user


def test_without_namespaces_the_tool_refuses_to_start_unless_allowed(monkeypatch, caplog):
    """Fault injected (a stand-in for a kernel that refuses user namespaces): the capability probe
    says so. The tool then refuses to build, naming the switch; with the switch it builds and warns."""
    refused = SandboxCapabilities(isolated=False, unprivileged_user=False, why="unshare(0x70020000) was refused")
    monkeypatch.setattr(sandbox, "sandbox_capabilities", lambda python, user: refused)
    with pytest.raises(ConfigError, match=r"rollout\.agent\.tools\[i\]\.options\.allow_unsandboxed: true"):
        build_tool("python", {})
    with pytest.raises(ConfigError, match="must be true or false"):
        build_tool("python", {"allow_unsandboxed": "yes"})
    with caplog.at_level(logging.WARNING, logger="rlx.agents.sandbox"):
        assert build_tool("python", {"allow_unsandboxed": True}).limits.allow_unsandboxed
    assert "UNSANDBOXED" in caplog.text and SWITCH in caplog.text


def test_doctor_reports_the_sandbox(capsys):
    assert main(["doctor", "examples/chain_sum_calculator_smollm2.yaml"]) == 0
    assert "# sandbox: isolated: the python tool and the reward pool run without network" in capsys.readouterr().err


@pytest.mark.parametrize("options,error", [({"allow_unsandboxed": "yes"}, "must be true or false, not 'yes'"),
                                           ({"alow_unsandboxed": True}, "are not python tool options")])
def test_the_config_checks_the_python_tools_options(options, error):
    with pytest.raises(ConfigError, match=r"rollout\.agent\.tools\.1 = (.|\n)*" + error):
        load_config("examples/chain_sum_calculator_smollm2.yaml",
                    [f"rollout.agent.tools=[{{name: calculator}}, {{name: python, options: {json.dumps(options)}}}]"])


FORGE = """import os
for pid in os.listdir('/proc'):
    if pid.isdigit() and int(pid) != os.getpid():
        try:
            fds = os.listdir(f'/proc/{pid}/fd')
        except OSError:
            continue
        for fd in fds:
            try:
                with open(f'/proc/{pid}/fd/{fd}', 'w') as pipe:
                    pipe.write('{"exit": 0}\\n')
            except OSError:
                pass
raise SystemExit(5)"""

BOMB = """import os, time
children = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        block = b'x' * (100 << 20)  # resident at once (a bytearray's zeros would not be)
        time.sleep(60)
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
print('survived')"""

SEES = """import json, os
paths = json.loads({paths!r})
print(json.dumps({{"exists": [os.path.exists(p) for p in paths], "tmp": os.listdir('/tmp'),
                  "cwd": os.getcwd(), "uid": os.getuid()}}))"""


def attacks(port: int, hidden: list[str]) -> dict[str, tuple[str, str]]:
    """(outcome, text) of each attack on the host: reach a loopback server at `port`, see the paths
    `hidden`, forge the report, and hold 400 MB in four processes under a 256 MB limit."""
    connect = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
    results = {}
    for name, code, limits in (("network", connect, {}), ("sees", SEES.format(paths=json.dumps(hidden)), {}),
                               ("forge", FORGE, {}), ("memory", BOMB, {"timeout_s": 30, "max_processes": 8})):
        result = run(code, **limits)
        results[name] = (result.outcome, result.text)
    return results


def check_attacks(results: dict[str, tuple[str, str]], hidden: list[str]) -> None:
    outcome, text = results["network"]
    assert outcome == "error" and "Network is unreachable" in text and "connected\n" not in text
    outcome, text = results["sees"]
    assert outcome == "ok", text
    seen = json.loads(text.splitlines()[0])
    assert seen["exists"] == [False] * len(hidden), dict(zip(hidden, seen["exists"], strict=True))
    assert seen["tmp"] == [os.path.basename(seen["cwd"])]  # a fresh /tmp: only the code's own folder
    assert seen["uid"] != 0
    outcome, text = results["forge"]
    assert outcome == "error" and text.endswith("[exit code 5]"), text
    outcome, text = results["memory"]
    assert outcome == "error" and "survived" not in text, text
    assert "past the limit of 256 MB; they were killed]" in text


def hidden_paths(data_dir: Path) -> list[str]:
    """What the code must not see: a world-readable data file with its labels, a file in the working
    directory, the checkout (rlx's source), a world-readable file in host /tmp."""
    data = data_dir / "train.jsonl"
    data.write_text('{"prompt": "6+6=", "label": "12"}\n')
    data.chmod(0o644)
    return [str(data), str(Path.cwd() / "pyproject.toml"), str(Path(_RLX_ROOT) / "rlx" / "isolation.py"),
            host_tmp_file()]


def host_tmp_file() -> str:
    handle, path = tempfile.mkstemp(prefix="rlx-host-tmp-", dir="/tmp")
    os.close(handle)
    os.chmod(path, 0o644)
    return path


def loopback_server() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    return server


def assert_nothing_accepted(server: socket.socket) -> None:
    with pytest.raises(TimeoutError):
        server.accept()


@pytest.fixture
def world_readable_dir():
    folder = Path(tempfile.mkdtemp(prefix="rlx-sandbox-test-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def test_the_code_reaches_no_network_no_host_file_no_report_and_no_more_memory(world_readable_dir):
    hidden = hidden_paths(world_readable_dir)
    try:
        with loopback_server() as server:
            results = attacks(server.getsockname()[1], hidden)
            assert_nothing_accepted(server)
    finally:
        os.unlink(hidden[-1])
    check_attacks(results, hidden)


def test_a_fresh_tmp_even_when_the_interpreter_lives_under_tmp(world_readable_dir):
    prefix = world_readable_dir / "python"  # its prefix is bound in, its neighbour in /tmp is not
    (prefix / "bin").mkdir(mode=0o755, parents=True)
    prefix.chmod(0o755)
    (prefix / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    neighbour = world_readable_dir / "neighbour.txt"
    neighbour.write_text("host /tmp")
    neighbour.chmod(0o644)
    code = f"import os\nprint(os.path.exists({str(neighbour)!r}), os.path.isdir({str(prefix)!r}))"
    result = run(code, python=str(prefix / "bin" / "python"))
    assert (result.outcome, result.text) == ("ok", "False True\n[exit code 0]")


_AS_NOBODY = '''
def _as_nobody():
    """As root: a mount and PID namespace of our own whose root shows the interpreter, the checkout
    and the test's folder (read-only: uid 65534 cannot reach an interpreter under /root otherwise),
    then run the driver as uid 65534. The network and the host's users stay as they are."""
    import json, os, sys
    spec = json.loads(sys.argv[1])
    _unshare(0x00020000 | 0x20000000)
    init = os.fork()
    if init:
        os._exit(os.waitstatus_to_exitcode(os.waitpid(init, 0)[1]) & 0xFF)
    _build_root(spec)
    driver = os.fork()
    if driver == 0:
        os.chdir(spec["cwd"])
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": spec["cwd"]}
        os.execve(sys.executable, [sys.executable, *sys.argv[2:]], env)
    while True:
        pid, status = os.wait()
        if pid == driver:
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)

_as_nobody()
'''


def test_the_sandbox_holds_for_an_unprivileged_host_user(world_readable_dir):
    """CI runs as root, where the sandbox has real privileges to build on. Here the whole attack list
    runs again from uid 65534, where only unprivileged user namespaces are left: it must hold the
    same (and its capability probe must say it is isolated, else this fails: never a skip)."""
    hidden = hidden_paths(world_readable_dir)
    os.unlink(hidden[-1])  # the unprivileged driver makes its own in the /tmp it sees
    command = [sys.executable, "-m", "tests.integration.test_sandbox", "PORT", json.dumps(hidden[:-1])]
    if os.geteuid() == 0:
        spec = {**confinement([*interpreter_paths(sys.executable), str(Path.cwd()), _RLX_ROOT, str(world_readable_dir)],
                              64, pid=True), "user": None, "cwd": str(Path.cwd())}
        command = [sys.executable, "-I", "-S", "-c", CONFINE_SOURCE + _AS_NOBODY, json.dumps(spec), *command[1:]]
    with loopback_server() as server:
        command[command.index("PORT")] = str(server.getsockname()[1])
        done = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        server.accept()[0].close()  # the driver's own connection: this user reaches the server
        assert_nothing_accepted(server)  # the sandboxed code did not
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["uid"] != 0 and report["capabilities"]["isolated"], report  # the preconditions
    assert report["capabilities"]["unprivileged_user"] and report["driver_connects"]
    check_attacks(report["results"], report["hidden"])
    check_pool_attacks(report["pool"])


def _unprivileged_driver(port: int, hidden: list[str]) -> None:
    """The driver of the test above: runs as the unprivileged user, prints what it found as JSON."""
    socket.create_connection(("127.0.0.1", port), timeout=5).close()  # this user reaches the server
    hidden = [*hidden, host_tmp_file()]
    report = {"uid": os.getuid(), "capabilities": vars(CAPS), "driver_connects": True, "hidden": hidden,
              "results": attacks(port, hidden), "pool": pool_attacks(port)}
    print(json.dumps(report))


def pool_attacks(port: int) -> dict[str, object]:
    """The reward pool's confinement as this user: a custom reward tries to write into a folder anyone
    may write, to reach the loopback server at `port`, and to read a token from its environment."""
    from rlx.rewards.pool import RewardFailure, RewardPool, RewardSpec

    folder = tempfile.mkdtemp()
    os.chmod(folder, 0o777)
    os.environ["RAY_AUTH_TOKEN"] = "secret"
    found: dict[str, object] = {}
    with RewardPool(max_workers=1) as pool:
        for name, metadata in (("writes_a_file", {"path": f"{folder}/escaped.txt"}), ("connects", {"port": port}),
                               ("sees", {"variable": "RAY_AUTH_TOKEN"})):
            spec = RewardSpec(f"tests.integration.escaping_rewards:{name}", "none", None, tuple(sys.path))
            try:
                found[name] = pool.call(spec, ("x", "x", metadata), 30.0)
            except RewardFailure as failure:
                found[name] = str(failure)
    found["written"] = os.listdir(folder)
    return found


def check_pool_attacks(found: dict[str, object]) -> None:
    assert "No such file" in str(found["writes_a_file"]) and found["written"] == [], found
    assert "Network is unreachable" in str(found["connects"]), found
    assert found["sees"] == 0.0, found


if __name__ == "__main__":
    _unprivileged_driver(int(sys.argv[1]), json.loads(sys.argv[2]))
