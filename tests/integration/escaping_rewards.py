"""Custom rewards that try to leave the reward pool's confinement (`module:function` specs): each
raises when the host stops it, and scores 1.0 only when it got through."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Any


def writes_a_file(completion: str, label: str, metadata: dict[str, Any]) -> float:
    with open(metadata["path"], "w") as out:
        out.write("escaped")
    return 1.0


def connects(completion: str, label: str, metadata: dict[str, Any]) -> float:
    socket.create_connection(("127.0.0.1", metadata["port"]), timeout=2).close()
    return 1.0


def sees(completion: str, label: str, metadata: dict[str, Any]) -> float:
    """1.0 when this process holds the token named by metadata["variable"] or runs as root."""
    return float(metadata["variable"] in os.environ or os.getuid() == 0)


def starts_a_marked_program_and_hangs(completion: str, label: str, metadata: dict[str, Any]) -> float:
    """A code-running reward whose program never ends; the program's command line carries metadata["marker"]."""
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", metadata["marker"]])
    time.sleep(600)
    return 0.0


class _OpensInTheParent:
    """Pickled as a call of open(path, "w"): whoever unpickles it creates the file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return open, (self.path, "w")


def replies_with_code(completion: str, label: str, metadata: dict[str, Any]) -> Any:
    """A taken-over worker's reply: unpickled as is, it would run in the pool's (unconfined) parent."""
    return _OpensInTheParent(metadata["path"])


def replies_at_length(completion: str, label: str, metadata: dict[str, Any]) -> Any:
    return "x" * (2 << 20)
