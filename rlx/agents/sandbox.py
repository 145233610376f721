"""The `python` tool: runs the model's code in a confined, limited process, or refuses to start.

Each call gets a fresh process tree, confined by rlx.isolation's primitive (the one the reward pool
uses), plus per-call limits:
- no network: a new network namespace with loopback down, so connecting anywhere (127.0.0.1
  included) fails.
- nothing of the host to see: a new mount namespace whose root holds only the system directories
  (/usr, /lib, a few /etc files) and the interpreter's prefix and site-packages, read-only; a fresh
  tmpfs of `disk_mb` on /tmp (also /var/tmp, /dev/shm; even when the interpreter lives under /tmp);
  /proc of its own PID namespace. The dataset and its labels, the working directory and checkout,
  editable installs, other sys.path entries, tokens and Ray's session directory are absent.
- not root: on a root host the code runs as `user` (nobody); otherwise the namespaces are made in an
  unprivileged user namespace of our own, and the code runs as the host's user, without capabilities.
- wall clock (`timeout_s`): the host kills every process the code started at the deadline.
- CPU time (`cpu_s`): RLIMIT_CPU, SIGXCPU at the limit and SIGKILL a second later.
- memory (`memory_mb`): RLIMIT_AS per process, and the init's watchdog over the resident memory of
  all the code's processes together (every 20 ms): past it, the whole tree is killed. The OOM killer
  takes the sandbox first (oom_score_adj 1000).
- processes (`max_processes`): RLIMIT_NPROC in a user namespace of the call's own, so it counts only
  this call's processes; no leftover processes: the PID namespace dies with its init, and the
  launcher is a child subreaper the host kills at the end.
- file size (`max_file_mb`), open files (`max_open_files`): RLIMIT_FSIZE, RLIMIT_NOFILE.
- privileges: PR_SET_NO_NEW_PRIVS (setuid binaries gain nothing).
- an honest report: the code's exit status travels on a pipe held only by the launcher, outside the
  code's PID namespace, and the init, both not dumpable: the code cannot open their /proc/<pid>/fd.

Fails closed: where the kernel refuses the namespaces (no unprivileged user namespaces), building the
tool raises a ConfigError unless `rollout.agent.tools[i].options.allow_unsandboxed: true`; with it,
the code runs with the limits only, as the host's user, seeing and reaching what that user can.

How: the host starts a small launcher (`python -I -S`, stdlib only, as the host's user) which
enters the namespaces and forks an init (pid 1 of the new PID namespace); the init builds the new
root, forks the code's process and reports to the launcher how it ended. The code's process sets the
limits, drops privileges and execs `python -I -u -c <code>`. A nonzero exit or a kill is an "error"
outcome, a timeout a "timeout"; the model reads the output with the exit code or signal either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import math
import os
import pwd
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import psutil

from rlx.agents.tool import Tool, ToolError, ToolTimeout
from rlx.errors import ConfigError
from rlx.isolation import CONFINE_SOURCE, confinement, interpreter_paths

log = logging.getLogger(__name__)

CAPTURE_BYTES = 64 * 1024  # kept from each end of the output; the ToolBox truncates further
STATUS_BYTES = 4096  # the launcher's report is one short line; more is not a report
SWITCH = "rollout.agent.tools[i].options.allow_unsandboxed"
_EXPLAINED = {signal.SIGXCPU: "the CPU time limit", signal.SIGKILL: "past the CPU limit, or out of memory",
              signal.SIGSEGV: "a segmentation fault (often a stack overflow)"}


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock
    cpu_s: float | None = None  # CPU seconds; None: the wall-clock limit rounded up
    memory_mb: int = 1024  # each process's address space, and all the code's processes' resident memory
    max_file_mb: int = 16
    max_open_files: int = 64
    max_processes: int = 8
    disk_mb: int = 64  # the private /tmp (RAM)
    user: str = "nobody"  # the unprivileged user the code runs as when the host is root
    python: str = sys.executable
    max_code_bytes: int = 100_000  # the code travels as one argv string (Linux caps those at 128 KiB)
    allow_unsandboxed: bool = False  # where the namespaces are refused: run with the limits only


@dataclass(frozen=True)
class SandboxCapabilities:
    isolated: bool  # network, mount, PID and (off root) user namespaces granted
    unprivileged_user: bool  # the code does not run as root
    why: str | None = None  # what the kernel refused, when not isolated


@dataclass
class SandboxRun:
    output: str  # stdout and stderr interleaved, the middle cut past 2 * CAPTURE_BYTES
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    memory_mb: int | None = None  # the tree's resident memory when the watchdog killed it
    setup_error: str | None = None
    applied: dict[str, Any] = dataclasses.field(default_factory=dict)  # the isolation that took effect

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and self.memory_mb is None

    def observation(self, limits: SandboxLimits) -> str:
        if self.timed_out:
            status = f"[stopped at the wall-clock limit of {limits.timeout_s:g} s; its processes were killed]"
        elif self.memory_mb is not None:
            status = (f"[stopped: its processes held {self.memory_mb} MB together, past the limit of "
                      f"{limits.memory_mb} MB; they were killed]")
        elif self.signal is not None:
            name = signal.strsignal(self.signal) or f"signal {self.signal}"
            because = f": {_EXPLAINED[self.signal]}" if self.signal in _EXPLAINED else ""
            status = f"[killed by signal {self.signal} ({name}){because}]"
        else:
            status = f"[exit code {self.exit_code}]"
        return f"{self.output}\n{status}" if self.output else f"(no output)\n{status}"


_PARAMETERS = {
    "type": "object",
    "properties": {"code": {"type": "string", "description": "a Python program; print the result"}},
    "required": ["code"],
}


class PythonTool(Tool):
    name = "python"
    description = ("Runs Python 3 code in a sandbox (no network, limited CPU time, memory and files, an "
                   "empty working directory) and returns what it prints (stdout and stderr) and its exit "
                   "code. Print the values you want to see.")
    parameters = _PARAMETERS
    grace_s = 5.0  # to kill and reap the process tree after the sandbox's own deadline

    def __init__(self, **limits: Any) -> None:
        if not isinstance(limits.get("allow_unsandboxed", False), bool):
            raise ConfigError(f"{SWITCH} must be true or false, not {limits['allow_unsandboxed']!r}")
        self.limits = SandboxLimits(**limits)  # an unknown option is a TypeError, which build_tool reports
        self.timeout_s = self.limits.timeout_s
        if not os.access(self.limits.python, os.X_OK):
            raise ConfigError(f"rollout.agent.tools: python tool option python={self.limits.python!r} is not an "
                              "executable; give the path of a Python interpreter")
        if os.geteuid() == 0:
            try:
                pwd.getpwnam(self.limits.user)
            except KeyError:
                raise ConfigError(f"rollout.agent.tools: python tool option user={self.limits.user!r} is not a "
                                  "user here; give an unprivileged user the code can run as") from None
        try:
            capabilities = sandbox_capabilities(self.limits.python, self.limits.user)
        except RuntimeError as error:
            raise ConfigError(f"rollout.agent.tools: the python tool cannot start here: {error}") from None
        if not capabilities.isolated:
            if not self.limits.allow_unsandboxed:
                raise ConfigError(
                    f"rollout.agent.tools: the python tool cannot be sandboxed here ({capabilities.why}): its code "
                    "would run as this user with the network and this user's files. Allow user namespaces (e.g. "
                    f"sysctl kernel.unprivileged_userns_clone=1), or set {SWITCH}: true to run it unsandboxed")
            log.warning("python tool: running model code UNSANDBOXED (%s: true): %s", SWITCH, capabilities.why)

    def run(self, arguments: dict) -> str:
        """Exit code 0 is an "ok" observation; a failing or killed program is an "error" one (the
        ToolBox counts them), with the same text: its output and how it ended."""
        limits = dataclasses.replace(self.limits, timeout_s=self.timeout_s)  # set by build_tool or the run
        result = run_sandboxed(arguments["code"], limits)
        if result.setup_error is not None:
            raise RuntimeError(f"the sandbox could not start the code: {result.setup_error}")
        text = result.observation(limits)
        if result.timed_out:
            raise ToolTimeout(text)
        if not result.ok:
            raise ToolError(text)
        return text


def run_sandboxed(code: str, limits: SandboxLimits) -> SandboxRun:
    """Run `code` under `limits`; returns when every process it started is gone."""
    size = len(code.encode())
    if size > limits.max_code_bytes:
        raise ToolError(f"Error: the code is {size} bytes; the limit is {limits.max_code_bytes}.")
    if "\0" in code:
        raise ToolError("Error: the code contains a NUL character.")
    workdir = tempfile.mkdtemp(prefix="rlx-sandbox-")  # the code's: on the host only when not isolated
    status_read, status_write = os.pipe()
    try:
        spec = _launch_spec(limits, workdir, status_write)
        proc = subprocess.Popen(
            [limits.python, "-I", "-S", "-c", _LAUNCHER_SOURCE, json.dumps(spec), code],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd="/",
            env={"PATH": "/usr/bin:/bin"}, start_new_session=True, pass_fds=(status_write,))
        os.close(status_write)
        status_write = -1
        try:
            run = _supervise(proc, status_read, limits.timeout_s)
        finally:
            _kill_tree(proc)
            proc.stdout.close()
    finally:
        for fd in (status_read, status_write):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
    return run


def _launch_spec(limits: SandboxLimits, workdir: str, status_fd: int) -> dict:
    cpu_s = limits.cpu_s if limits.cpu_s is not None else limits.timeout_s
    confine = confinement(interpreter_paths(limits.python), limits.disk_mb, pid=True, workdir=workdir,
                          user=limits.user)
    if confine["user"] is not None:
        os.chown(workdir, *confine["user"])  # used as is where the namespaces are refused
    return {"status_fd": status_fd, "python": limits.python, "confine": confine,
            "allow_unsandboxed": limits.allow_unsandboxed, "cpu_s": max(1, math.ceil(cpu_s)),
            "memory": limits.memory_mb << 20, "file": limits.max_file_mb << 20, "files": limits.max_open_files,
            "processes": limits.max_processes}


class _Capture:
    """The first and the last CAPTURE_BYTES of a stream, whatever its length."""

    def __init__(self) -> None:
        self.head, self.tail, self.total = bytearray(), bytearray(), 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = CAPTURE_BYTES - len(self.head)
        self.head += chunk[:room]
        self.tail += chunk[room:] if room > 0 else chunk
        del self.tail[:-CAPTURE_BYTES]

    def text(self) -> str:
        cut = self.total - len(self.head) - len(self.tail)
        middle = f"\n[... {cut} bytes of output omitted ...]\n".encode() if cut > 0 else b""
        return (bytes(self.head) + middle + bytes(self.tail)).decode("utf-8", "replace").rstrip("\n")


def _supervise(proc: subprocess.Popen, status_fd: int, timeout_s: float) -> SandboxRun:
    """Read output and status until the code's process ends or the deadline passes, then kill
    whatever it left and read the rest of its output."""
    assert proc.stdout is not None
    output_fd, deadline = proc.stdout.fileno(), time.monotonic() + timeout_s
    capture, status_text, run = _Capture(), b"", SandboxRun("")
    poller = select.poll()  # not select.select: a busy process may hold file descriptors past 1024
    for fd in (output_fd, status_fd):
        poller.register(fd, select.POLLIN)
    open_fds, status = {output_fd, status_fd}, {}
    while open_fds and not {"exit", "signal", "error", "memory"} & status.keys():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            run.timed_out = True
            break
        for fd, _ in poller.poll(remaining * 1000):
            chunk = os.read(fd, 65536)
            if not chunk:
                poller.unregister(fd)
                open_fds.discard(fd)
            elif fd == status_fd:
                status_text = (status_text + chunk)[:STATUS_BYTES]
                status = _parse_status(status_text)
            else:
                capture.add(chunk)
    _kill_tree(proc)  # every writer of the output pipe is gone after this, so its reading ends
    while output_fd in open_fds and poller.poll(1000):
        chunk = os.read(output_fd, 65536)
        if not chunk:
            break
        capture.add(chunk)
    status = _parse_status((status_text + _read_rest(status_fd))[:STATUS_BYTES])
    run.output, run.applied = capture.text(), status.get("applied", {})
    run.exit_code, run.signal, run.setup_error = status.get("exit"), status.get("signal"), status.get("error")
    run.memory_mb = status.get("memory")
    if not ({"exit", "signal", "error", "memory"} & status.keys() or run.timed_out):
        run.setup_error = f"the launcher ended with status {proc.returncode} without a report"
    return run


def _parse_status(text: bytes) -> dict:
    status: dict = {}
    for line in text.decode(errors="replace").split("\n")[:-1]:  # complete lines only
        with contextlib.suppress(ValueError):
            fields = json.loads(line)
            status.update(fields if isinstance(fields, dict) else {})
    return status


def _read_rest(fd: int) -> bytes:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, STATUS_BYTES)
    except BlockingIOError:
        return b""


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL everything below the launcher (as a subreaper it keeps orphans below it) until
    nothing is left alive, then let the launcher reap them and leave (killing it if it does not)."""
    if proc.returncode is not None:
        return  # reaped already: its pid may belong to another process by now
    try:
        launcher = psutil.Process(proc.pid)
        for _ in range(1000):  # a fork bomb refills the tree until every process in it is killed
            alive = [child for child in launcher.children(recursive=True) if _alive(child)]
            if not alive:
                break
            for child in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            time.sleep(0.01)
    except psutil.NoSuchProcess:  # the launcher ended on its own: its tree is gone with it
        pass
    try:
        proc.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@functools.cache
def sandbox_capabilities(python: str = sys.executable, user: str = "nobody") -> SandboxCapabilities:
    """What isolation this platform grants the sandbox, found by running `pass` in it once."""
    run = run_sandboxed("pass", SandboxLimits(timeout_s=30.0, python=python, user=user, allow_unsandboxed=True))
    if run.setup_error is not None or not run.ok:
        raise RuntimeError(f"the python sandbox does not start here: {run.setup_error or run.output}")
    return SandboxCapabilities(bool(run.applied.get("isolated")), bool(run.applied.get("user")),
                               run.applied.get("why"))


def sandbox_report() -> str:
    """One line for `rlx doctor`: whether this host confines the python tool and the reward pool."""
    try:
        capabilities = sandbox_capabilities()
    except RuntimeError as error:
        return f"the python sandbox does not start here: {error}"
    if capabilities.isolated:
        who = f"as {SandboxLimits.user}" if os.geteuid() == 0 else "as this user in a user namespace"
        return ("isolated: the python tool and the reward pool run without network, with only the interpreter "
                f"(and the pool its import path) read-only and a private /tmp, {who}")
    return (f"NOT isolated here ({capabilities.why}): the python tool refuses to start unless {SWITCH}: true, "
            "and reward pool processes fail to start")


def _launcher() -> None:  # pragma: no cover - runs as `python -I -S -c`, see _LAUNCHER_SOURCE
    """Three processes: this launcher (a child subreaper, so nothing the code starts can leave the
    tree the host kills; the only holder of the status pipe) enters the namespaces and forks an init
    (pid 1 of the new PID namespace: when it exits, the kernel kills everything left in it), which
    builds the new root, forks the code's process, watches the tree's memory and tells the launcher
    how the code ended. The code is not pid 1 itself because pid 1 ignores default-action signals
    such as SIGXCPU. Neither the launcher nor the init is dumpable, so the code cannot reopen their
    pipes through /proc/<pid>/fd."""
    import ctypes
    import json
    import os
    import resource
    import signal
    import sys

    spec, code = json.loads(sys.argv[1]), sys.argv[2]
    confine, status_fd = spec["confine"], spec["status_fd"]
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig, pr_set_dumpable, pr_set_child_subreaper, pr_set_no_new_privs = 1, 4, 36, 38
    os.set_inheritable(status_fd, False)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)  # die with the host thread that started us
    libc.prctl(pr_set_child_subreaper, 1)

    def report(fd: int, **fields: object) -> None:
        os.write(fd, (json.dumps(fields) + "\n").encode())

    try:
        _enter(confine)  # noqa: F821 - defined by CONFINE_SOURCE, above this function in the script
        isolated, why = True, None
    except OSError as exc:
        if not spec["allow_unsandboxed"]:
            report(status_fd, error=f"the sandbox could not isolate the code: {exc}")
            os._exit(127)
        isolated, why = False, str(exc)
    libc.prctl(pr_set_dumpable, 0)  # after _enter wrote /proc/self; inherited by the init, not past the code's exec
    result_read, result_write = os.pipe()
    init = os.fork()
    if init:  # the launcher: forward the init's report, then reap whatever is left below us
        os.close(result_write)
        text = b""
        while len(text) < 4096 and (chunk := os.read(result_read, 4096)):
            text += chunk
        fields: dict = {}
        for line in text.decode(errors="replace").split("\n")[:-1]:
            fields.update(json.loads(line))
        user = confine["user"] is not None or os.getuid() != 0
        report(status_fd, applied={"isolated": isolated, "why": why, "user": user}, **fields)
        while True:
            try:
                os.wait()
            except ChildProcessError:
                return

    def fail(exc: BaseException) -> None:
        hint = ""
        if isinstance(exc, PermissionError) and confine["user"] is not None:
            hint = (f" (the code runs as uid {confine['user'][0]}, which may not reach {spec['python']}: set the "
                    "python tool's option `python` to an interpreter that user can run)")
        report(result_write, error=f"{type(exc).__name__}: {exc}{hint}")
        os._exit(127)

    def limit(which: int, soft: int, hard: int) -> None:
        ceiling = resource.getrlimit(which)[1]
        if ceiling != resource.RLIM_INFINITY:
            soft, hard = min(soft, ceiling), min(hard, ceiling)
        resource.setrlimit(which, (soft, hard))

    def own_processes(uid: int) -> int:  # not isolated: RLIMIT_NPROC counts every process of the user
        count = 0
        for entry in os.listdir("/proc"):
            try:
                count += entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid
            except OSError:  # the process ended between listdir and stat: not counted
                pass
        return count

    def exec_code() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        for which, soft, hard in ((resource.RLIMIT_CPU, spec["cpu_s"], spec["cpu_s"] + 1),
                                  (resource.RLIMIT_AS, spec["memory"], spec["memory"]),
                                  (resource.RLIMIT_FSIZE, spec["file"], spec["file"]),
                                  (resource.RLIMIT_NOFILE, spec["files"], spec["files"]),
                                  (resource.RLIMIT_CORE, 0, 0)):
            limit(which, soft, hard)
        if confine["user"] is not None:
            os.setgroups([])
            os.setgid(confine["user"][1])
            os.setuid(confine["user"][0])
        libc.prctl(pr_set_dumpable, 1)  # it is about to run the code anyway; /proc/self/uid_map needs it
        if isolated:
            _unshare(0x10000000)  # noqa: F821 - a user namespace of this call's own: RLIMIT_NPROC counts only it
        processes = spec["processes"] + (0 if isolated else own_processes(os.getuid()))
        limit(resource.RLIMIT_NPROC, processes, processes)
        libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0)
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)  # fork and the change of uid cleared it
        workdir = confine["workdir"]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        os.execve(spec["python"], [spec["python"], "-I", "-u", "-c", code], env)

    def tree_memory() -> int:
        """The resident bytes of every process in our PID namespace but this init."""
        total, page = 0, os.sysconf("SC_PAGE_SIZE")
        for entry in os.listdir("/proc"):
            if entry.isdigit() and entry != "1":
                try:
                    with open(f"/proc/{entry}/statm") as statm:
                        total += int(statm.read().split()[1]) * page
                except (OSError, IndexError, ValueError):  # ended meanwhile
                    pass
        return total

    try:  # the init
        os.close(status_fd)
        os.close(result_read)
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
        if isolated:
            _build_root(confine)  # noqa: F821 - defined by CONFINE_SOURCE
        os.chdir(confine["workdir"])
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # woken by sigtimedwait below
        code_pid = os.fork()
    except BaseException as exc:  # noqa: BLE001 - reported to the host, whatever it is
        fail(exc)
    if code_pid == 0:
        try:
            exec_code()
        except BaseException as exc:  # noqa: BLE001 - reported to the host, whatever it is
            fail(exc)
    while True:  # as pid 1 the init also reaps the code's orphans, which would count against RLIMIT_NPROC
        pid, wait_status = os.waitpid(-1, os.WNOHANG)
        if pid == code_pid:
            break
        if pid == 0:
            if isolated and (used := tree_memory()) > spec["memory"]:
                report(result_write, memory=used >> 20)
                os._exit(0)  # the kernel kills the rest of our PID namespace
            signal.sigtimedwait({signal.SIGCHLD}, 0.02)
    if os.WIFSIGNALED(wait_status):
        report(result_write, signal=os.WTERMSIG(wait_status))
    else:
        report(result_write, exit=os.WEXITSTATUS(wait_status))
    os._exit(0)


_LAUNCHER_SOURCE = CONFINE_SOURCE + inspect.getsource(_launcher) + "\n_launcher()\n"
