"""Shared fixtures: a tiny model built in code (no hub), written once per test session; and which
tests run one at a time when the suite runs on several workers (`make test`: pytest-xdist)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rlx.models import load_pretrained
from rlx.models.tiny import build_tiny

# Test files that start a Ray cluster, rank processes or a vLLM engine (each busies both cores) run
# in two lanes with `-n 2 --dist loadgroup`: each lane is one xdist group, its files one at a time on
# one worker, the two lanes side by side. ONE_AT_A_TIME holds the runs that time faults (kills, hangs,
# heartbeats, a SIGKILL mid-checkpoint) and those that look at every rank process on the machine;
# SECOND_LANE holds the runs that only need their own cluster. Every other file is a group of its own
# (its module fixtures built once, its tests in file order), run beside them on either worker:
# servers on loopback ports of their own, environment and sandbox processes marked per test. Every
# file of tests/system is in one of the lanes but SYSTEM_BESIDE.
ONE_AT_A_TIME = {
    "test_async_resume.py", "test_cluster_security.py", "test_cuda.py", "test_fault_tolerance.py",
    "test_listeners.py", "test_management_api.py", "test_sharded_runs.py", "test_sharded_trainer.py",
    "test_vllm_server_adapter.py",
}
SECOND_LANE = {
    "test_async_mode.py", "test_bench_agentic.py", "test_ray_bus.py", "test_url_engines.py",
    "test_vllm_engine.py", "test_vllm_routed_experts.py", "test_vllm_runs.py", "test_weight_sync.py",
}
# Files of tests/system that start none of those (colocated runs on one process, the CLI and the TRL
# bench in subprocesses of their own): whole runs, but nothing the lanes must not see, so they run
# beside them and neither lane is the suite's long pole.
SYSTEM_BESIDE = {"test_agent_runs.py", "test_bench_trl.py", "test_cli.py", "test_omni_runs.py",
                 "test_moe_runs.py", "test_smollm2.py", "test_vision_runs.py"}


def _lane(item: pytest.Item) -> str | None:
    """The lane of a test that starts a cluster (None: its file is a group of its own)."""
    path = Path(str(item.path))
    if path.name in SECOND_LANE:
        return "second_lane"
    if path.name in ONE_AT_A_TIME or (path.parent.name == "system" and path.name not in SYSTEM_BESIDE):
        return "one_at_a_time"
    return None


def pytest_itemcollected(item: pytest.Item) -> None:
    """Grouped as each test is collected, before any collection hook (xdist's too) reads the marks."""
    item.add_marker(pytest.mark.xdist_group(_lane(item) or Path(str(item.path)).stem))


@pytest.fixture(autouse=True)
def _in_process_tests_start_no_cluster(request):
    """Keeps the lanes true: a test outside them that leaves a Ray cluster running fails, and the
    cluster is shut down so the tests after it do not fail for it. (A test that starts and stops
    Ray within itself goes unseen: list its file when you write it.)"""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and _lane(request.node) is None and ray.is_initialized():
        ray.shutdown()
        pytest.fail(f"{request.node.path.name} started a Ray cluster: add it to a lane in tests/conftest.py")


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("models") / "tiny-char", hidden=64, layers=2, heads=4, seed=0)


@pytest.fixture()
def tiny(tiny_path):
    """A fresh (model, tokenizer) pair; tests may train or mutate it."""
    torch.manual_seed(0)
    return load_pretrained(tiny_path)


@pytest.fixture(scope="session")
def tiny_vision_path(tmp_path_factory):
    """A tiny LLaVA: the tiny-char Llama with a one-layer CLIP tower for 8x8 images (4 tokens each)."""
    from rlx.models.vision import build_tiny_vision

    return build_tiny_vision(tmp_path_factory.mktemp("models") / "tiny-vision")


@pytest.fixture(scope="session")
def tiny_audio_path(tmp_path_factory):
    """A tiny AudioFlamingo3: the tiny-char Llama with a one-layer Whisper encoder reading 2 s windows."""
    from rlx.models.audio import build_tiny_audio

    return build_tiny_audio(tmp_path_factory.mktemp("models") / "tiny-audio")
