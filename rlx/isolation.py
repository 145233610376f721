"""Killable child processes for user code that may misbehave: rewards and environments.

User code may hold the GIL past its deadline, call sys.exit, end the interpreter or start programs
of its own; a thread running it cannot be stopped, a process (and its process group) can. The
parent side is `ChildProcess`; the child side is `serve_requests`, run by a module the parent starts
as `python -m <module> FD` (never multiprocessing, so the child never re-imports the parent's
`__main__`: a Ray worker, pytest). They talk over a socket pair; a request is (op, payload,
self_destruct_s), a reply ("ok", value) or ("error", message).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import json
import logging
import os
import pickle
import pwd
import signal
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Generic, Self, TypeVar

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0
CONFINED_TMP_MB = 256  # a confined child's private /tmp (RAM)
MAX_REPLY_BYTES = 1 << 20  # a confined child's reply: a reward, a group's rewards or an error's text
MAX_ERROR_TEXT = 16_000  # characters of a child's exception text sent back (a reward's error is logged)
_RLX_ROOT = str(Path(__file__).resolve().parents[1])  # so `python -m rlx...` works from a source tree too


class ProcessFailure(Exception):
    """A call into a child process failed; the message says why, `kind` classifies it."""

    kind = "error"


class ProcessTimeout(ProcessFailure, TimeoutError):
    kind = "timeout"


class ProcessCrash(ProcessFailure):
    kind = "crash"


def _exit_description(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


def self_destruct_after(timeout_s: float | None) -> float | None:
    """When a child ends itself if its parent has not killed it: a little after the parent's deadline."""
    return None if timeout_s is None else timeout_s + STOP_TIMEOUT_S


class _PlainUnpickler(pickle.Unpickler):
    """Numbers, strings, lists, tuples, dicts and None (pickle builds those without classes), and
    numpy scalars; any other class is refused, so unpickling runs no code of the sender's choosing."""

    _ALLOWED = frozenset({("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"), ("numpy", "dtype")})

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not plain data")
        return super().find_class(module, name)


class ChildProcess:
    """One child process running `module` and the parent's end of its socket pair. `label` names it
    in errors ("the reward process ..."). `confined`: isolate it once as it starts (`confinement`: no
    network, the interpreter and the import path read-only, a private /tmp, no tokens in its
    environment, unprivileged) before it imports anything. `imports=False` shows it the interpreter
    and rlx's own package only, not the working directory or the rest of the import path (where a
    checkout keeps its data and run directories)."""

    def __init__(self, module: str, label: str, confined: bool = False, imports: bool = True) -> None:
        self.label, self.confined = label, confined
        ours, theirs = socket.socketpair()
        path = os.pathsep.join(filter(None, [_RLX_ROOT, os.environ.get("PYTHONPATH")]))
        argv = [sys.executable, "-m", module, str(theirs.fileno())]
        env = {**os.environ, "PYTHONPATH": path}
        if confined:
            imports = ([_RLX_ROOT, os.getcwd(), *path.split(os.pathsep), *filter(os.path.isabs, sys.path)]
                       if imports else [os.path.join(_RLX_ROOT, "rlx")])
            _warn_unreadable(tuple(imports))
            spec = {**confinement([*interpreter_paths(sys.executable), *imports], CONFINED_TMP_MB, pid=False),
                    "cwd": os.getcwd(), "fd": theirs.fileno(), "env": {**confined_env(), "PYTHONPATH": path}}
            argv = [sys.executable, "-I", "-S", "-c", CONFINE_SOURCE + "_confined_exec()\n", json.dumps(spec),
                    "--", *argv]
        self.proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True)  # its own process group: see `kill`
        theirs.close()
        self.conn = Connection(ours.detach())
        self.ready = False  # its first message (sent once it has started) has been read

    @property
    def alive(self) -> bool:
        return not self.conn.closed

    def answer(self, timeout_s: float | None, late: str) -> Any:
        """The next reply's payload; a late or dead child is killed and raises ProcessTimeout/ProcessCrash."""
        try:
            on_time = self.conn.poll(timeout_s)
            status, payload = self._receive() if on_time else ("late", None)
        except (EOFError, OSError):
            code = self._reap()
            raise ProcessCrash(f"the {self.label} process {_exit_description(code)} during the call") from None
        if status == "late":
            self.kill()
            raise ProcessTimeout(f"{late}; its {self.label} process was killed")
        if status == "error":
            raise ProcessFailure(payload)
        return payload

    def _receive(self) -> tuple:
        """A confined child runs code that may have been taken over (the model's text reached an eval):
        its reply is read with a byte bound and unpickled as plain data only, never as code (N16)."""
        if not self.confined:
            return self.conn.recv()
        try:
            data = self.conn.recv_bytes(MAX_REPLY_BYTES)
        except OSError as error:
            if "bad message length" not in str(error):
                raise
            self.kill()
            raise ProcessFailure(f"the {self.label} process sent a reply over {MAX_REPLY_BYTES} bytes; it was "
                                 "killed") from None
        try:
            return _PlainUnpickler(io.BytesIO(data)).load()
        except (pickle.UnpicklingError, ValueError, TypeError, EOFError) as error:
            raise ProcessFailure(f"the {self.label} process sent a reply that is not plain data: {error}") from None

    def request(self, message: tuple, timeout_s: float | None, late: str) -> Any:
        try:
            self.conn.send(message)
        except OSError:
            code = self._reap()
            raise ProcessCrash(f"the {self.label} process {_exit_description(code)} before the call") from None
        return self.answer(timeout_s, late)

    def started(self, timeout_s: float) -> None:
        """Wait (once) for the child to start, up to `timeout_s`."""
        if not self.ready:
            self.answer(timeout_s, f"the {self.label} process did not start within {timeout_s}s")
            self.ready = True

    def _reap(self) -> int | None:
        """Wait for the child to end (a little), then end what it started: its process group."""
        self.conn.close()
        try:
            code = self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        with contextlib.suppress(ProcessLookupError):  # nothing of its group is left
            os.killpg(self.proc.pid, signal.SIGKILL)
        return code

    def kill(self) -> None:
        """The child and whatever it started (user code that runs a program): its whole process group."""
        self.conn.close()
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """Closing its socket ends an idle child; one that does not end in time is killed."""
        self._reap()


Child = TypeVar("Child", bound=ChildProcess)


def _kill_all(children: set[ChildProcess]) -> None:
    for child in list(children):
        child.kill()
    children.clear()


class ProcessPool(Generic[Child]):
    """Up to `max_workers` warm child processes made by `new_child`: `checkout` lends one (starting
    one, or waiting for one to come back, when none is idle), `checkin` takes it back. The pool
    starts no threads, and no child outlives it."""

    def __init__(self, new_child: Callable[[], Child], max_workers: int, label: str) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers={max_workers}: a {label} pool needs at least one process")
        self.max_workers, self.label, self._new_child = max_workers, label, new_child
        self.replaced = 0  # children killed or dead and started anew
        self._workers: set[Child] = set()
        self._idle: list[Child] = []
        self._cond = threading.Condition()
        self._closed = False
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)

    def pids(self) -> list[int]:
        with self._cond:
            return [w.proc.pid for w in self._workers]

    def checkout(self) -> Child:
        with self._cond:
            while True:
                if self._closed:
                    raise ProcessFailure(f"the {self.label} pool is closed")
                while self._idle:
                    worker = self._idle.pop()
                    if worker.proc.poll() is None:
                        return worker
                    self._workers.discard(worker)  # died while idle (OOM killer, a stray kill)
                    worker.kill()
                if len(self._workers) < self.max_workers:
                    return self._start()
                self._cond.wait()

    def _start(self) -> Child:
        worker = self._new_child()
        self._workers.add(worker)
        return worker

    def checkin(self, worker: Child) -> None:
        """Keep a healthy child warm; replace a killed or dead one at once, so it boots while idle."""
        with self._cond:
            if worker.alive and not self._closed:
                self._idle.append(worker)
            else:
                self._workers.discard(worker)
                if not worker.alive and not self._closed:
                    self._idle.append(self._start())
                    self.replaced += 1
            self._cond.notify()
        if worker.alive and self._closed:
            worker.stop()

    def close(self) -> None:
        """Stop idle children now and lent ones when they come back; later checkouts fail."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._workers.difference_update(idle)
            self._cond.notify_all()
        for worker in idle:
            worker.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_requests(conn: Connection, handle: Callable[[str, Any], Any]) -> None:
    """The child's loop: `handle(op, payload)` for each request, in the main thread (so user code's
    own signal-based timeouts work), until the parent closes the socket. An exception, SystemExit
    included, becomes an error reply and the child serves on. Each request arms a kernel alarm, so a
    child whose parent died while user code held the GIL still ends shortly after its deadline."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the kernel ends us at the alarm, GIL or not
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes us
    conn.send(("ok", None))
    while True:
        try:
            op, payload, self_destruct_s = conn.recv()
        except EOFError:  # the parent closed our socket (or died): nothing more to do
            return
        if self_destruct_s is not None:
            signal.setitimer(signal.ITIMER_REAL, self_destruct_s)
        try:
            reply = ("ok", handle(op, payload))
        except BaseException as exc:  # noqa: BLE001 - user code failed; this process serves on
            message = f"{type(exc).__name__}: {exc}"
            cut = len(message) - MAX_ERROR_TEXT
            reply = ("error", message[:MAX_ERROR_TEXT] + f" [... {cut} more characters]" if cut > 0 else message)
        signal.setitimer(signal.ITIMER_REAL, 0)
        try:
            conn.send(reply)
        except Exception as exc:  # noqa: BLE001 - the value would not pickle
            conn.send(("error", f"the value returned is a {type(reply[1]).__name__}, which cannot be sent back: {exc}"))


# --- Confinement: one primitive for the python tool's sandbox and the reward pool's workers ----------
# `_unshare`, `_enter` and `_build_root` use only the standard library and nothing else of this module:
# their source also runs in a bare `python -I -S -c` launcher (CONFINE_SOURCE, and the python tool's).

CONFINE_USER = "nobody"  # a root host runs confined code as this user
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache",
                 "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/passwd", "/etc/group",
                 "/etc/nsswitch.conf", "/etc/alternatives", "/etc/ssl")
_ENV_KEPT = ("PATH", "LANG", "TZ", "PYTHONHASHSEED", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE",
             "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def interpreter_paths(python: str) -> list[str]:
    """What an interpreter needs to start: its prefix (a venv) and its base installation, with their
    site-packages; never the rest of the import path (editable installs, the working directory)."""
    paths = {os.path.dirname(os.path.dirname(os.path.abspath(python))),
             os.path.dirname(os.path.dirname(os.path.realpath(python)))}
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        import site

        paths |= {sys.prefix, sys.base_prefix, *site.getsitepackages()}
    return sorted(path for path in paths if os.path.isdir(path))


def confinement(binds: list[str], tmp_mb: int, pid: bool, workdir: str | None = None,
                user: str = CONFINE_USER) -> dict:
    """The spec `_enter` and `_build_root` take: what stays visible (read-only), the private /tmp's
    size, whether to add a PID namespace, and, on a root host, the unprivileged `user` to become."""
    ids = None
    if os.geteuid() == 0:
        entry = pwd.getpwnam(user)
        ids = [entry.pw_uid, entry.pw_gid]
    return {"binds": sorted({*_SYSTEM_PATHS, *binds}), "tmp_bytes": tmp_mb << 20, "pid": pid, "user": ids,
            "workdir": workdir}


def _unshare(flags: int) -> None:
    """unshare(2) `flags`; with CLONE_NEWUSER, map our own uid and gid (all an unprivileged user may map)."""
    import ctypes
    import os

    uid, gid = os.getuid(), os.getgid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flags) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"unshare({flags:#x}) was refused: {os.strerror(errno)}")
    if flags & 0x10000000:  # CLONE_NEWUSER
        for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as out:
                out.write(text)


def _enter(spec: dict) -> None:
    """New mount and network namespaces (a PID one too with spec["pid"]: the next child is its init),
    inside a user namespace of our own when not root; first, mark this tree for the OOM killer."""
    import os

    with open("/proc/self/oom_score_adj", "w") as out:
        out.write("1000")
    flags = 0x00020000 | 0x40000000  # CLONE_NEWNS | CLONE_NEWNET (loopback down: nothing to connect to)
    _unshare(flags | (0x20000000 if spec["pid"] else 0) | (0x10000000 if os.getuid() else 0))


def _build_root(spec: dict) -> None:
    """Replace this mount namespace's root with a tmpfs that holds only the system directories and
    spec["binds"], each read-only; /dev's harmless nodes; a fresh, size-capped /tmp (also /var/tmp and
    /dev/shm); /proc of our PID namespace when there is one. Nothing else of the host is there."""
    import ctypes
    import os
    import platform

    libc = ctypes.CDLL(None, use_errno=True)
    nosuid, nodev, noexec, ms_bind, ms_rec, ms_private = 2, 4, 8, 4096, 16384, 1 << 18

    def check(result: int, what: str) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        def encode(text: str | None) -> bytes | None:
            return None if text is None else text.encode()
        check(libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
              f"mounting {target}")

    def seal(path: str, recursive: bool) -> None:  # mount_setattr(2): read-only, nosuid, nodev
        attr = (ctypes.c_uint64 * 4)(1 | 2 | 4, 0, 0, 0)
        check(libc.syscall(ctypes.c_long(442), ctypes.c_long(-100), path.encode(),
                           ctypes.c_long(0x8000 if recursive else 0), attr, ctypes.c_long(32)),
              f"making {path} read-only")

    os.umask(0o022)
    mount("none", "/", None, ms_rec | ms_private)  # nothing mounted here reaches the host
    kept: list[str] = []
    for path in spec["binds"]:  # sorted: a parent comes before what it holds
        if os.path.lexists(path) and not any(path.startswith(parent + "/") for parent in kept):
            kept.append(path)
    links = {path: os.readlink(path) for path in kept if os.path.islink(path)}
    handles = {path: os.open(path, os.O_PATH) for path in kept if path not in links}  # before /tmp is covered
    devices = {name: os.open(f"/dev/{name}", os.O_PATH) for name in ("null", "zero", "full", "random", "urandom")}
    new = "/tmp"  # exists everywhere and is replaced anyway: the new root's mount point
    mount("tmpfs", new, "tmpfs", nosuid | nodev, "size=1m,mode=0755")
    os.mkdir(new + "/tmp")  # the private /tmp first: what is bound below it (an interpreter) stays on top
    mount("tmpfs", new + "/tmp", "tmpfs", nosuid | nodev, f"size={spec['tmp_bytes']},mode=1777")
    for path, target in links.items():
        os.makedirs(os.path.dirname(new + path), exist_ok=True)
        os.symlink(target, new + path)
    for group, prefix, entries in (("bind", "", handles), ("dev", "/dev/", devices)):
        for path, handle in entries.items():
            target = new + prefix + path
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if os.path.isdir(f"/proc/self/fd/{handle}"):
                os.makedirs(target, exist_ok=True)
            else:
                open(target, "w").close()
            mount(f"/proc/self/fd/{handle}", target, None, ms_bind | ms_rec)
            os.close(handle)
            if group == "bind":
                seal(target, recursive=True)
    for name, target in (("dev/fd", "/proc/self/fd"), ("dev/stdin", "/proc/self/fd/0"),
                         ("dev/stdout", "/proc/self/fd/1"), ("dev/stderr", "/proc/self/fd/2"),
                         ("dev/shm", "/tmp"), ("var/tmp", "/tmp")):
        os.makedirs(os.path.dirname(f"{new}/{name}"), exist_ok=True)
        os.symlink(target, f"{new}/{name}")
    os.makedirs(new + "/proc", exist_ok=True)
    if spec["pid"]:  # while the host's /proc is still here: an unprivileged proc mount needs one in view
        mount("proc", new + "/proc", "proc", nosuid | nodev | noexec)
    os.chdir(new)
    check(libc.syscall(ctypes.c_long({"x86_64": 155, "aarch64": 41}[platform.machine()]), b".", b"."), "pivot_root")
    check(libc.umount2(b".", ctypes.c_int(2)), "detaching the host's root")  # MNT_DETACH
    os.chdir("/")
    if spec["workdir"]:
        owner = spec["user"] or [os.getuid(), os.getgid()]
        os.makedirs(spec["workdir"], mode=0o700)
        os.chown(spec["workdir"], *owner)
    seal("/", recursive=False)


def _confined_exec() -> None:  # pragma: no cover - runs as `python -I -S -c`, see CONFINE_SOURCE
    """Confine this process once (`_enter`, `_build_root`, the unprivileged user on a root host), then
    become the command after `--`. A failure goes to the parent on the socket `spec["fd"]`."""
    import json
    import os
    import sys

    spec, argv = json.loads(sys.argv[1]), sys.argv[3:]
    try:
        _enter(spec)
        _build_root(spec)
        os.chdir(spec["cwd"] if os.path.isdir(spec["cwd"]) else "/tmp")
        if spec["user"]:
            os.setgroups([])
            os.setgid(spec["user"][1])
            os.setuid(spec["user"][0])
        env = {**spec["env"], "HOME": "/tmp", "TMPDIR": "/tmp"}
    except OSError as exc:
        from multiprocessing.connection import Connection

        why = (f"the process could not be confined ({exc}); confined processes need unprivileged user "
               "namespaces, or root with CAP_SYS_ADMIN")
        Connection(spec["fd"]).send(("error", why))
        os._exit(126)
    os.execve(argv[0], argv, env)


CONFINE_SOURCE = "".join(inspect.getsource(fn) + "\n" for fn in (_unshare, _enter, _build_root, _confined_exec))


@functools.cache
def _warn_unreadable(imports: tuple[str, ...]) -> None:
    """On a root host confined code runs as CONFINE_USER: an import folder others may not read (a
    mkdtemp folder, a 0700 project) cannot be imported from there, which the reward's own error
    ("No module named ...") would not explain."""
    if os.geteuid() != 0:
        return
    closed = sorted({path for path in imports if os.path.isdir(path) and os.stat(path).st_mode & 0o005 != 0o005})
    if closed:
        log.warning("reward pool processes run as %r, which may not read %s: modules there will not import "
                    "(chmod o+rx them, or keep reward code in a readable folder)", CONFINE_USER, ", ".join(closed))


def confined_env() -> dict[str, str]:
    """The environment a confined process gets: locale, path and offline switches; never a token."""
    return {key: value for key, value in os.environ.items() if key in _ENV_KEPT or key.startswith("LC_")}
