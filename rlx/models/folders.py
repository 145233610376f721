"""Writing a built-in model's Hugging Face folder: complete or absent, never half."""

from __future__ import annotations

import shutil
from pathlib import Path


def save_model_folder(model, tokenizer, target: Path) -> Path:
    """Save into `<target>.partial`, then rename: an interrupted build leaves no folder that
    `resolve_model_path` would take for a finished one."""
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(target)
    return target
