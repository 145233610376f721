"""Tiny random-init Qwen-VL models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) built from a config in code.

They keep the released patch geometry (patch 14 or 16, temporal patch 2, merge 2), so the processor in
`rlx.media.qwen_vl` is exercised as for a real checkpoint, while the towers are small enough to run a
forward in well under a second on CPU. Token ids for the vision markers sit at the top of a 128 vocab.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from rlx.media.qwen_vl import QwenVisionSpec

if TYPE_CHECKING:  # transformers costs seconds to import: only the function that builds needs it
    from transformers import PreTrainedModel

VLFamily = Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
VL_FAMILIES: tuple[VLFamily, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

VOCAB_SIZE = 128
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
VISION_START_ID, VISION_END_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 124, 125, 126, 127
HIDDEN, LAYERS, HEADS, KV_HEADS = 64, 2, 4, 2
VISION_WIDTH, VISION_DEPTH, VISION_HEADS = 32, 2, 2
# M-RoPE splits the head's HIDDEN // HEADS // 2 = 8 rotary frequencies between time, height and width
MROPE_SECTION = {"qwen2_vl": [2, 3, 3], "qwen2_5_vl": [2, 3, 3], "qwen3_vl": [4, 2, 2]}


def _text_config(family: VLFamily) -> dict:
    text = {"vocab_size": VOCAB_SIZE, "hidden_size": HIDDEN, "intermediate_size": HIDDEN * 2,
            "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "max_position_embeddings": 1024, "pad_token_id": PAD_ID,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": MROPE_SECTION[family]}}
    if family == "qwen3_vl":
        return {**text, "head_dim": HIDDEN // HEADS}
    return {**text, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID}  # Qwen3-VL's text config has neither


def _vision_config(family: VLFamily) -> dict:
    if family == "qwen2_vl":
        return {"depth": VISION_DEPTH, "embed_dim": VISION_WIDTH, "hidden_size": HIDDEN, "num_heads": VISION_HEADS,
                "mlp_ratio": 2, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
    shared = {"depth": VISION_DEPTH, "hidden_size": VISION_WIDTH, "intermediate_size": VISION_WIDTH * 2,
              "num_heads": VISION_HEADS, "out_hidden_size": HIDDEN, "spatial_merge_size": 2, "temporal_patch_size": 2}
    if family == "qwen2_5_vl":  # one windowed block, one full-attention block
        return {**shared, "patch_size": 14, "window_size": 112, "fullatt_block_indexes": [VISION_DEPTH - 1],
                "tokens_per_second": 2}
    return {**shared, "patch_size": 16, "num_position_embeddings": 256, "deepstack_visual_indexes": [0]}


def tiny_vl_model(family: VLFamily, seed: int = 0) -> tuple[PreTrainedModel, QwenVisionSpec]:
    """A tiny random-init Qwen-VL model of `family` (fp32, eval mode) and the vision spec its inputs need."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )

    classes = {"qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
               "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
               "qwen3_vl": (Qwen3VLConfig, Qwen3VLForConditionalGeneration)}
    if family not in classes:
        raise ValueError(f"family={family!r}: tiny VL models come in {', '.join(VL_FAMILIES)}")
    config_class, model_class = classes[family]
    config = config_class(text_config=_text_config(family), vision_config=_vision_config(family),
                          image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID,
                          vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID,
                          tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_class(config).float().eval()
    return model, QwenVisionSpec.from_model_config(model.config)


MARKERS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")  # ids 124..127, in order


def build_tiny_vl(path: Path, family: VLFamily = "qwen2_vl") -> Path:
    """A tiny Qwen-VL folder with the tiny-char tokenizer, whose vocabulary is padded with unused
    tokens so Qwen's marker tokens land on the model's ids: a model `rlx train` can run."""
    from rlx.models.tiny import char_tokenizer

    tokenizer = char_tokenizer()
    unused = [f"<|unused{i}|>" for i in range(VISION_START_ID - len(tokenizer))]
    tokenizer.add_special_tokens({"additional_special_tokens": [*unused, *MARKERS]})
    assert tokenizer.convert_tokens_to_ids(list(MARKERS)) == [VISION_START_ID, VISION_END_ID, IMAGE_TOKEN_ID,
                                                              VIDEO_TOKEN_ID] and len(tokenizer) == VOCAB_SIZE
    model, _ = tiny_vl_model(family)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD_ID, EOS_ID
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
