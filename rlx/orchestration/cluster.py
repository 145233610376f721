"""Start (or join) a Ray cluster. A local one listens for its driver on loopback where Ray allows and
always requires Ray's token authentication; a joined one must require it too, unless the config
says otherwise.

Ray takes its token from, in order: `$RAY_AUTH_TOKEN`, the file at `$RAY_AUTH_TOKEN_PATH`,
`~/.ray/auth_token`. For a local cluster rlx writes that file (mode 0600) when there is none.

Ray releases before 2.60 run every Serve replica's gRPC server on `[::]` without checking the token
(ray-project/ray#65189: unauthenticated pickle), so rlx refuses them unless the config opts out. A
local cluster keeps its session files (sockets, logs, spilled objects) under a directory of this
user's alone (`ray_temp_dir`), not Ray's world-writable default.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import ray
from ray._private import ray_constants
from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, Config, get_authentication_mode

from rlx.errors import ConfigError
from rlx.weights.broadcast import HOST_ENV

AUTH_MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
TOKEN_SOURCES = f"${TOKEN_ENV}, the file at ${TOKEN_PATH_ENV}, or ~/.ray/auth_token"
PROBE_TIMEOUT_S = 90.0
AUTH_REFUSED = 3  # the probe's exit status when the cluster refuses a client without a token
MIN_RAY = (2, 60)  # the first release whose Serve replicas check the token on their gRPC port (ray#65189)

# Run in a fresh interpreter with token auth off: it connects to the GCS without a token.
_PROBE = f"""
import sys
from ray._private.services import canonicalize_bootstrap_address_or_die
from ray._raylet import GcsClient
from ray.exceptions import AuthenticationError
try:
    GcsClient(address=canonicalize_bootstrap_address_or_die(sys.argv[1])).internal_kv_keys(b"", None, timeout=10)
except AuthenticationError:
    sys.exit({AUTH_REFUSED})
"""


def token_file() -> Path:
    """Where Ray reads the token from when `$RAY_AUTH_TOKEN` is unset."""
    return Path(os.environ.get(TOKEN_PATH_ENV) or Path.home() / ".ray" / "auth_token")


def ensure_token_file(path: Path) -> None:
    """A token file readable by its owner only: created (atomically, so a concurrent start never
    reads it half-written) when missing, its mode tightened to 0600 when it exists."""
    if path.exists():
        if path.stat().st_mode & 0o077:
            path.chmod(0o600)
        return
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, staged = tempfile.mkstemp(dir=path.parent, prefix=".auth_token.")  # mkstemp creates it 0600
    try:
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32))
        os.link(staged, path)
    except FileExistsError:  # another process created it first: use theirs
        pass
    finally:
        os.unlink(staged)


def enable_token_auth() -> None:
    """Token mode for this process and every process it starts, with a token they all find."""
    if not os.environ.get(TOKEN_ENV):
        ensure_token_file(token_file())
    use_token_auth()


def join_with_token(address: str) -> None:
    """Token mode for a driver joining `address`, with the cluster's own token (never a new one)."""
    if not os.environ.get(TOKEN_ENV) and not token_file().exists():
        raise ConfigError(f"resources.ray_address={address!r} requires a token and this machine has none: give "
                          f"the cluster's token in {TOKEN_SOURCES}")
    use_token_auth()


def use_token_auth() -> None:
    """Switch this process (and what it starts) to Ray's token mode, reading the token afresh."""
    os.environ[AUTH_MODE_ENV] = "token"
    Config.initialize("")  # Ray read its settings at import; let it see the mode now
    AuthenticationTokenLoader.instance().reset_cache()  # a token cached by an earlier cluster is stale


def require_token_auth(address: str) -> None:
    """Refuse to join a cluster that accepts a client without a token: whoever reaches it could run
    code in this run's workers. A fresh interpreter without a token tries its GCS."""
    if address.startswith("ray://"):
        raise ConfigError(f"resources.ray_address={address!r}: rlx cannot check that a Ray Client endpoint "
                          "requires a token; give the cluster's GCS address (host:port), or set "
                          "resources.ray_allow_unauthenticated=true to join it anyway")
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_PATH_ENV)}
    with tempfile.TemporaryDirectory() as home:  # no ~/.ray/auth_token there
        # this interpreter's import path: a HOME elsewhere hides user site-packages (pip install --user)
        env.update({AUTH_MODE_ENV: "disabled", "HOME": home, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
        try:
            probe = subprocess.run([sys.executable, "-c", _PROBE, address], check=False, env=env,
                                   capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ConnectionError(f"resources.ray_address={address!r}: no answer within {PROBE_TIMEOUT_S:.0f}s; "
                                  "is the cluster up and reachable from here?") from None
    if probe.returncode == 0:
        raise ConfigError(
            f"resources.ray_address={address!r} accepts clients without a token, so anyone who can reach it "
            "can run code in this run. Start its nodes with RAY_AUTH_MODE=token and a token (from "
            f"{TOKEN_SOURCES}; `ray get-auth-token --generate` makes one), give this machine the same token, "
            "or set resources.ray_allow_unauthenticated=true to join it anyway")
    if probe.returncode != AUTH_REFUSED:
        tail = probe.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise ConnectionError(f"resources.ray_address={address!r}: cannot reach the cluster: {tail[0]}")


def ray_release(version: str) -> tuple[int, int]:
    """(major, minor) of a Ray version string: `2.60.0` -> (2, 60); a dev build `3.0.0.dev0` -> (3, 0)."""
    major, minor = (version.split(".") + ["0"])[:2]
    return int(major), int(re.match(r"\d*", minor).group() or 0)


def require_safe_ray(allow_unauthenticated: bool) -> None:
    """Refuse a Ray whose Serve replicas accept unauthenticated gRPC calls, unless the config allows
    clusters that accept clients without a token anyway."""
    if ray_release(ray.__version__) < MIN_RAY and not allow_unauthenticated:
        raise ConfigError(
            f"Ray {ray.__version__} is installed: before {MIN_RAY[0]}.{MIN_RAY[1]} its Serve replicas listen on every "
            "interface and run unauthenticated requests (ray-project/ray#65189), so anyone who can reach this "
            f"machine could run code in the run. Install 'ray[serve]>={MIN_RAY[0]}.{MIN_RAY[1]}', or set "
            "resources.ray_allow_unauthenticated=true to run on it anyway")


def ray_temp_dir() -> Path:
    """`$TMPDIR/rlx-ray-<uid>`, this user's alone (0700): Ray's own default, /tmp/ray, is shared by every
    user, with world-writable session folders and world-readable logs. Refused if another user (or a
    link) holds the name."""
    path = Path(tempfile.gettempdir()) / f"rlx-ray-{os.getuid()}"
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:  # an earlier run's: checked below to be this user's own directory
        pass
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise RuntimeError(f"{path} is not a directory of this user's (a link, a file, or another user's): remove "
                           "it, or set $TMPDIR to a directory of your own, so Ray's session files stay private")
    if info.st_mode & 0o077:
        path.chmod(0o700)
    return path


def start_ray(num_cpus: float | None = None, address: str | None = None,
              allow_unauthenticated: bool = False) -> None:
    """A new local cluster with token authentication; `address` joins an existing one, which must
    require a token (Ray reads it from $RAY_AUTH_TOKEN, the file at $RAY_AUTH_TOKEN_PATH or
    ~/.ray/auth_token) unless `allow_unauthenticated`."""
    if ray.is_initialized():
        return
    require_safe_ray(allow_unauthenticated)
    if address:
        if not allow_unauthenticated:
            require_token_auth(address)
            join_with_token(address)
        ray.init(address=address, log_to_driver=False)
        return
    # This variable keeps a single-node cluster on the loopback interface. Ray reads it when it is
    # imported, so the driver (already past its import) gets the constant set directly (without it the
    # node registers with the host's address despite `_node_ip_address`); the processes Ray starts
    # inherit the variable.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray_constants.ENABLE_RAY_CLUSTER = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] not in ("0", "false", "False")
    enable_token_auth()
    os.environ.setdefault(HOST_ENV, "127.0.0.1")  # the weight channel's rendezvous stays on this machine
    # workers import user code (custom rewards) the way the driver does: from the working directory
    # (Ray itself also puts the driver's directory first on its workers' path, py_driver_sys_path)
    python_path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    ray.init(
        address="local",  # always a new cluster: never attach to a crashed run's leftovers
        num_cpus=num_cpus,
        runtime_env={"env_vars": {"PYTHONPATH": python_path, HOST_ENV: os.environ[HOST_ENV]}},
        _node_ip_address="127.0.0.1",
        _temp_dir=str(ray_temp_dir()),
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    if get_authentication_mode() != AuthenticationMode.TOKEN:  # fail closed if Ray ignored the mode
        ray.shutdown()
        raise RuntimeError(f"Ray started without token authentication although {AUTH_MODE_ENV}=token was set")



def stop_ray() -> None:
    if ray.is_initialized():
        ray.shutdown()
