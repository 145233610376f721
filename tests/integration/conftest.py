"""Fixtures for integration tests (the session's tiny model is in tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture()
def one_thread():
    """One intra-op thread: tiny-model training is ~15x faster on a shared 2-core box than with
    threads that wait on each other, and pinned numbers need one summation order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
