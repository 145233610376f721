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


def test_a_builtin_model_asked_for_by_several_at_once_is_built_once(tmp_path, monkeypatch):
    """Roles of one run (or tests on two workers) that resolve a built-in model at the same time
    wait for one build instead of writing the same folder together."""
    import threading
    import time

    from rlx import models

    builds = []

    def slow_build(target):
        builds.append(target)
        time.sleep(0.3)  # long enough for every other thread to find no folder yet
        target.mkdir()
        (target / "config.json").write_text("{}")
        return target

    monkeypatch.setitem(models.BUILTIN_MODELS, "slow", models.BuiltinModel("slow", "", lambda: True, slow_build))
    found = []
    threads = [threading.Thread(target=lambda: found.append(models.resolve_model_path("slow", tmp_path)))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 1 and found == [tmp_path / "slow"] * 4
