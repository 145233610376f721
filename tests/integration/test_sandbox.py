"""The python tool's sandbox against hostile code: each attack is stopped or refused with a clear
observation, nothing it started survives the call, and this process carries on.

Real processes throughout. Limits are small so the file stays fast: 2 s of CPU, 2 s of wall clock
where the test is about the wall clock (elsewhere 20 s, so a loaded machine cannot make a trivial
program time out).
Where the platform does not grant an isolation feature (`sandbox_capabilities()`), the test that
needs it is skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from rlx.agents.sandbox import sandbox_capabilities
from rlx.agents.tools import ToolBox, build_tool
from rlx.errors import ConfigError

try:
    CAPS = sandbox_capabilities()
except RuntimeError as error:
    if "may not reach" not in str(error):
        raise
    pytest.skip(f"the sandbox user cannot run this interpreter and the platform grants no mount namespace to "
                f"reveal it: {error}", allow_module_level=True)
needs_netns = pytest.mark.skipif(not CAPS.network_namespace, reason="no network namespace on this platform "
                                 "(unshare(CLONE_NEWNET) refused): the sandbox cannot cut the network here")
needs_mountns = pytest.mark.skipif(not CAPS.mount_namespace, reason="no mount namespace on this platform: "
                                   "the sandbox cannot give the code a private, size-capped /tmp here")


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


@needs_mountns
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


@needs_netns
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


@needs_netns
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


@pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare(1) to compare with")
def test_capabilities_match_what_the_platform_allows():
    """A silent fallback would weaken the sandbox unnoticed: where unshare(1) can make a network
    namespace, the sandbox must have used one too."""
    allowed = subprocess.run(["unshare", "--net", "true"], capture_output=True, check=False).returncode == 0
    assert CAPS.network_namespace == allowed
