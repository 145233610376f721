"""Shared fixtures: a tiny model built in code (no hub), written once per test session."""

from __future__ import annotations

import pytest
import torch

from rlx.models import load_pretrained
from rlx.models.tiny import build_tiny


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
