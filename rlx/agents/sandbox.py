"""The `python` tool: runs the model's code in a separate, limited process.

Each call gets a fresh process and an empty temporary working directory (removed afterwards).
What is enforced, how, and where:
- wall clock (`timeout_s`): the host kills every process the code started at the deadline. Always.
- CPU time (`cpu_s`): RLIMIT_CPU, SIGXCPU at the limit and SIGKILL a second later. Always.
- memory (`memory_mb`, per process): RLIMIT_AS; allocations past it fail (MemoryError). Always.
- file size (`max_file_mb`): RLIMIT_FSIZE; writes past it fail ("File too large"). Always.
- open files (`max_open_files`): RLIMIT_NOFILE. Always.
- processes (`max_processes`): RLIMIT_NPROC, which root ignores: as root the code runs as `user`
  (nobody); otherwise as the current user, with the limit counted above the processes it has.
- no leftover processes: the launcher is a child subreaper, so orphans stay in the tree that the
  host kills when the code's process ends; with a PID namespace (where `unshare(CLONE_NEWPID)` is
  allowed, i.e. as root) they also die with the namespace's init, setsid or not.
- no network: a new network namespace, loopback down, so connecting anywhere (127.0.0.1 included)
  fails. Where `unshare(CLONE_NEWNET)` is allowed (root).
- disk (`disk_mb`): a new mount namespace with a size-capped tmpfs on /tmp, /var/tmp, /dev/shm and
  the working directory, a /proc showing only the sandbox's processes, and directories others may
  not enter (e.g. /root) hidden except for the path to the interpreter. Where `unshare(CLONE_NEWNS)`
  and mounting are allowed (root); elsewhere only the per-file limit holds.
- privileges: PR_SET_NO_NEW_PRIVS (setuid binaries gain nothing). Always.

Not enforced: the code can read whatever its user can read on the host (no chroot) and, without a
mount namespace, write where that user can. As root, RLIMIT_NPROC counts every process of `user`,
so concurrent sandboxes share `max_processes`: a fork bomb in one can make another's fork fail
until it is killed at its deadline. `sandbox_capabilities()` reports which of these this platform
grants (tests skip, with the reason, what it lacks); a run logs once what it could not enforce.

How: the host starts a small launcher (`python -I -S`, stdlib only, as the host's user) which
enters the namespaces and forks an init; the init mounts, forks the code's process and reports on
a private pipe how it ended. The code's process sets the limits, drops privileges and execs
`python -I -u -c <code>`. A nonzero exit or a kill is an "error" outcome, a timeout a "timeout";
the model reads the output with the exit code or signal either way.
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
from dataclasses import dataclass, field
from typing import Any

import psutil

from rlx.agents.tools import TOOLS, Tool, ToolError, ToolTimeout
from rlx.errors import ConfigError

log = logging.getLogger(__name__)

CAPTURE_BYTES = 64 * 1024  # kept from each end of the output; the ToolBox truncates further
_EXPLAINED = {signal.SIGXCPU: "the CPU time limit", signal.SIGKILL: "past the CPU limit, or out of memory",
              signal.SIGSEGV: "a segmentation fault (often a stack overflow)"}


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock
    cpu_s: float | None = None  # CPU seconds; None: the wall-clock limit rounded up
    memory_mb: int = 1024  # address space
    max_file_mb: int = 16
    max_open_files: int = 64
    max_processes: int = 64
    disk_mb: int = 64  # each private tmpfs, where a mount namespace is granted
    user: str = "nobody"  # the unprivileged user the code runs as when the host is root
    python: str = sys.executable
    max_code_bytes: int = 100_000  # the code travels as one argv string (Linux caps those at 128 KiB)


@dataclass(frozen=True)
class SandboxCapabilities:
    network_namespace: bool
    pid_namespace: bool
    mount_namespace: bool
    unprivileged_user: bool  # the code does not run as root

    def missing(self) -> list[str]:
        return [name for name, granted in vars(self).items() if not granted]


@dataclass
class SandboxRun:
    output: str  # stdout and stderr interleaved, the middle cut past 2 * CAPTURE_BYTES
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    setup_error: str | None = None
    applied: dict[str, bool] = field(default_factory=dict)  # isolation that took effect

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def observation(self, limits: SandboxLimits) -> str:
        if self.timed_out:
            status = f"[stopped at the wall-clock limit of {limits.timeout_s:g} s; its processes were killed]"
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


@TOOLS.register("python")
class PythonTool(Tool):
    name = "python"
    description = ("Runs Python 3 code in a sandbox (no network, limited CPU time, memory and files, an "
                   "empty working directory) and returns what it prints (stdout and stderr) and its exit "
                   "code. Print the values you want to see.")
    parameters = _PARAMETERS
    grace_s = 5.0  # to kill and reap the process tree after the sandbox's own deadline

    def __init__(self, **limits: Any) -> None:
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
    workdir = tempfile.mkdtemp(prefix="rlx-sandbox-")
    status_read, status_write = os.pipe()
    try:
        spec = _launch_spec(limits, workdir, status_write)
        proc = subprocess.Popen(
            [limits.python, "-I", "-S", "-c", _LAUNCHER_SOURCE, json.dumps(spec), code],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=workdir,
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
    _warn_once(tuple(sorted(k for k, granted in run.applied.items() if not granted)))
    return run


def _launch_spec(limits: SandboxLimits, workdir: str, status_fd: int) -> dict:
    cpu_s = limits.cpu_s if limits.cpu_s is not None else limits.timeout_s
    spec = {"workdir": workdir, "status_fd": status_fd, "python": limits.python, "uid": None, "gid": None,
            "needed": _interpreter_paths(limits.python), "cpu_s": max(1, math.ceil(cpu_s)),
            "memory": limits.memory_mb << 20, "file": limits.max_file_mb << 20,
            "files": limits.max_open_files, "processes": limits.max_processes, "disk": limits.disk_mb << 20}
    if os.geteuid() == 0:
        user = pwd.getpwnam(limits.user)
        spec["uid"], spec["gid"] = user.pw_uid, user.pw_gid
        os.chown(workdir, user.pw_uid, user.pw_gid)  # used as is where no private tmpfs replaces it
    return spec


def _interpreter_paths(python: str) -> list[str]:
    """What the code's interpreter reads: its binary and, for this interpreter, its prefixes and
    import path (a venv, editable installs)."""
    binary = os.path.realpath(python)
    paths = {binary, os.path.dirname(os.path.dirname(binary))}
    if binary == os.path.realpath(sys.executable):
        paths |= {sys.prefix, sys.base_prefix, *(entry for entry in sys.path if os.path.isabs(entry))}
    return sorted(path for path in paths if os.path.exists(path))


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
    while open_fds and not {"exit", "signal", "error"} & status.keys():
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
                status_text += chunk
                status = _parse_status(status_text)
            else:
                capture.add(chunk)
    _kill_tree(proc)  # every writer of the output pipe is gone after this, so its reading ends
    while output_fd in open_fds and poller.poll(1000):
        chunk = os.read(output_fd, 65536)
        if not chunk:
            break
        capture.add(chunk)
    status = _parse_status(status_text + _read_rest(status_fd))
    run.output, run.applied = capture.text(), status.get("applied", {})
    run.exit_code, run.signal, run.setup_error = status.get("exit"), status.get("signal"), status.get("error")
    if run.exit_code is None and run.signal is None and run.setup_error is None and not run.timed_out:
        run.setup_error = f"the launcher ended with status {proc.returncode} without a report"
    return run


def _parse_status(text: bytes) -> dict:
    status: dict = {}
    for line in text.decode().split("\n")[:-1]:  # complete lines only
        status.update(json.loads(line))
    return status


def _read_rest(fd: int) -> bytes:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 65536)
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
def _warn_once(missing: tuple[str, ...]) -> None:
    if missing:
        log.warning("python tool sandbox: this platform did not grant %s; rlx.agents.sandbox says what that "
                    "leaves unenforced", ", ".join(missing))


@functools.cache
def sandbox_capabilities(python: str = sys.executable) -> SandboxCapabilities:
    """What isolation this platform grants the sandbox, found by running `pass` in it once."""
    run = run_sandboxed("pass", SandboxLimits(timeout_s=30.0, python=python))
    if run.setup_error is not None or not run.ok:
        raise RuntimeError(f"the python sandbox does not start here: {run.setup_error or run.output}")
    return SandboxCapabilities(**{name: bool(run.applied.get(key)) for name, key in (
        ("network_namespace", "network"), ("pid_namespace", "pid"), ("mount_namespace", "mount"),
        ("unprivileged_user", "user"))})


def _launcher() -> None:  # pragma: no cover - runs as `python -I -S -c`, see _LAUNCHER_SOURCE
    """Three processes: this launcher (a child subreaper, so nothing the code starts can leave the
    tree the host kills) enters the namespaces and forks an init (pid 1 of the new PID namespace
    where granted: when it exits, the kernel kills everything left in it), which mounts, forks the
    code's process and reports how that ended. The code is not pid 1 itself because pid 1 ignores
    default-action signals such as SIGXCPU."""
    import ctypes
    import json
    import os
    import resource
    import signal
    import sys

    spec, code = json.loads(sys.argv[1]), sys.argv[2]
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig, pr_set_child_subreaper, pr_set_no_new_privs = 1, 36, 38
    nosuid_nodev, ms_noexec, ms_bind, ms_rec, ms_private = 2 | 4, 8, 4096, 16384, 1 << 18

    def report(**fields: object) -> None:
        os.write(spec["status_fd"], (json.dumps(fields) + "\n").encode())

    def fail(exc: BaseException) -> None:
        hint = ""
        if isinstance(exc, PermissionError) and spec["uid"] is not None:
            hint = (f" (the code runs as uid {spec['uid']}, which may not reach {spec['python']}: set the "
                    "python tool's option `python` to an interpreter that user can run)")
        report(error=f"{type(exc).__name__}: {exc}{hint}")
        os._exit(127)

    def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> bool:
        encode = (lambda text: text.encode() if text is not None else None)
        return libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags),
                          encode(data)) == 0

    def reveal(paths: list[str]) -> bool:
        """Make `paths` reachable for an unprivileged user: a directory on the way that others may
        not enter (e.g. /root holding a pyenv) is covered by a tmpfs holding only bind mounts of the
        entries on the way, so the rest of it stays hidden."""
        for _ in range(8):
            blocked: dict[str, set[str]] = {}
            for path in paths:
                parts = path.strip("/").split("/")
                for depth, name in enumerate(parts):
                    directory = "/" + "/".join(parts[:depth])
                    if not os.stat(directory).st_mode & 0o001:
                        blocked.setdefault(directory, set()).add(name)
                        break
            if not blocked:
                return True
            for directory, names in blocked.items():
                handles = {name: os.open(os.path.join(directory, name), os.O_PATH) for name in names}
                if not mount("tmpfs", directory, "tmpfs", nosuid_nodev, "size=1m,mode=0755"):
                    return False
                for name, handle in handles.items():
                    target, source = os.path.join(directory, name), f"/proc/self/fd/{handle}"
                    if os.path.isdir(source):
                        os.mkdir(target)
                    else:
                        open(target, "w").close()
                    if not mount(source, target, None, ms_bind | ms_rec, None):
                        return False
                    os.close(handle)
        return False

    def private_mounts(workdir: str, uid: int, gid: int) -> bool:
        if not mount("none", "/", None, ms_rec | ms_private, None):  # nothing we mount reaches the host
            return False
        if uid != 0 and not reveal(spec["needed"]):
            return False
        size = spec["disk"]
        for shared in ("/tmp", "/var/tmp", "/dev/shm"):
            if not os.path.isdir(shared) or any(path.startswith(shared + "/") for path in spec["needed"]):
                continue  # covering it would hide the interpreter
            if not mount("tmpfs", shared, "tmpfs", nosuid_nodev, f"size={size},mode=1777"):
                return False
        if os.path.isdir(workdir):  # not under a directory just replaced: give it its own tmpfs
            owned = f"size={size},mode=0700,uid={uid},gid={gid}"
            if not mount("tmpfs", workdir, "tmpfs", nosuid_nodev, owned):
                return False
        else:
            os.makedirs(workdir, mode=0o700)
            os.chown(workdir, uid, gid)
        if applied["pid"]:
            mount("proc", "/proc", "proc", nosuid_nodev | ms_noexec, None)
        return True

    def own_processes(uid: int) -> int:
        count = 0
        for entry in os.listdir("/proc"):
            try:
                count += entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid
            except OSError:  # the process ended between listdir and stat: not counted
                pass
        return count

    def limit(which: int, soft: int, hard: int) -> None:
        ceiling = resource.getrlimit(which)[1]
        if ceiling != resource.RLIM_INFINITY:
            soft, hard = min(soft, ceiling), min(hard, ceiling)
        resource.setrlimit(which, (soft, hard))

    def exec_code(uid: int | None, gid: int | None) -> None:
        processes = spec["processes"] + (own_processes(os.getuid()) if uid is None else 0)
        for which, soft, hard in ((resource.RLIMIT_CPU, spec["cpu_s"], spec["cpu_s"] + 1),
                                  (resource.RLIMIT_AS, spec["memory"], spec["memory"]),
                                  (resource.RLIMIT_FSIZE, spec["file"], spec["file"]),
                                  (resource.RLIMIT_NOFILE, spec["files"], spec["files"]),
                                  (resource.RLIMIT_NPROC, processes, processes),
                                  (resource.RLIMIT_CORE, 0, 0)):
            limit(which, soft, hard)
        if uid is not None:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
        applied["user"] = os.getuid() != 0
        libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0)
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)  # fork and the change of uid cleared it
        report(applied=applied)
        workdir = spec["workdir"]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        os.execve(spec["python"], [spec["python"], "-I", "-u", "-c", code], env)

    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)  # die with the host thread that started us
    libc.prctl(pr_set_child_subreaper, 1)
    applied = {"network": libc.unshare(0x40000000) == 0,  # CLONE_NEWNET
               "mount": libc.unshare(0x00020000) == 0,  # CLONE_NEWNS
               "pid": libc.unshare(0x20000000) == 0}  # CLONE_NEWPID: the next child is its init
    if os.fork():
        while True:  # reap the init and whatever the host kills below us, then leave
            try:
                os.wait()
            except ChildProcessError:
                return
    try:  # the init
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
        os.set_inheritable(spec["status_fd"], False)  # the code must not write fake reports
        uid, gid = spec["uid"], spec["gid"]
        if applied["mount"]:
            applied["mount"] = private_mounts(spec["workdir"], os.getuid() if uid is None else uid,
                                              os.getgid() if gid is None else gid)
        os.chdir(spec["workdir"])
        code_pid = os.fork()
    except BaseException as exc:  # noqa: BLE001 - reported to the host, whatever it is
        fail(exc)
    if code_pid == 0:
        try:
            exec_code(uid, gid)
        except BaseException as exc:  # noqa: BLE001 - reported to the host, whatever it is
            fail(exc)
    while True:  # as pid 1 the init also reaps the code's orphans, which would count against RLIMIT_NPROC
        pid, wait_status = os.wait()
        if pid == code_pid:
            break
    if os.WIFSIGNALED(wait_status):
        report(signal=os.WTERMSIG(wait_status))
    else:
        report(exit=os.WEXITSTATUS(wait_status))
    os._exit(0)


_LAUNCHER_SOURCE = inspect.getsource(_launcher) + "\n_launcher()\n"
