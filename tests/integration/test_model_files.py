"""Model folders load from safetensors only: a pickled `pytorch_model.bin` can run code when loaded."""

from __future__ import annotations

import shutil

import pytest
import torch

from rlx.models import load_pretrained


def test_a_folder_with_only_pickled_weights_is_refused(tiny_path, tmp_path):
    folder = tmp_path / "pickled"
    shutil.copytree(tiny_path, folder)
    state = load_pretrained(tiny_path)[0].state_dict()
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(OSError, match="safetensors"):
        load_pretrained(folder)
