"""Tiny random-init Qwen-Omni thinkers (text, images, videos and audio) built from a config in code.

Qwen2.5-Omni's vision tower keeps Qwen2.5-VL's patch geometry (patch 14, windowed attention) and
Qwen3-Omni's Qwen3-VL's (patch 16, a deepstack layer); both keep temporal patch 2 and merge 2, and the
audio towers Whisper's 128 mel bins and their released attention windows (2 s; 1 s for Qwen3-Omni),
so rlx's processor is exercised as for the released checkpoints while a forward runs in well under a
second on CPU. Qwen3-Omni's language model is a mixture of experts (4 experts, top 2). The seven media
markers sit at the top of a 128-token vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:  # transformers costs seconds to import: only the functions that build need it
    from transformers import PreTrainedModel

VOCAB_SIZE = 128
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
VISION_START_ID, VISION_END_ID, AUDIO_START_ID, AUDIO_END_ID = 121, 122, 123, 124
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, AUDIO_TOKEN_ID = 125, 126, 127
# the released thinker's marker names, in id order from VISION_START_ID
MARKERS = ("<|vision_bos|>", "<|vision_eos|>", "<|audio_bos|>", "<|audio_eos|>", "<|IMAGE|>", "<|VIDEO|>", "<|AUDIO|>")
HIDDEN, LAYERS, HEADS, KV_HEADS = 64, 2, 4, 2
OmniFamily = Literal["qwen2_5_omni", "qwen3_omni"]
OMNI_FAMILIES: tuple[OmniFamily, ...] = ("qwen2_5_omni", "qwen3_omni")
MARKER_IDS = {"vision_start_token_id": VISION_START_ID, "vision_end_token_id": VISION_END_ID,
              "audio_start_token_id": AUDIO_START_ID, "audio_end_token_id": AUDIO_END_ID}


def _config(family: OmniFamily):
    from transformers import Qwen2_5OmniThinkerConfig, Qwen3OmniMoeThinkerConfig

    text = {"vocab_size": VOCAB_SIZE, "hidden_size": HIDDEN, "intermediate_size": HIDDEN * 2,
            "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "max_position_embeddings": 4096, "pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
            # M-RoPE splits the head's HIDDEN // HEADS // 2 = 8 frequencies between time, height and width
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": HIDDEN,
              "spatial_merge_size": 2, "temporal_patch_size": 2}
    audio = {"num_mel_bins": 128, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
             "d_model": 32, "output_dim": HIDDEN, "max_source_positions": 1500}
    if family == "qwen2_5_omni":
        return Qwen2_5OmniThinkerConfig(
            text_config=text, audio_config={**audio, "n_window": 100},
            vision_config={**vision, "patch_size": 14, "window_size": 112, "fullatt_block_indexes": [1]},
            image_token_index=IMAGE_TOKEN_ID, video_token_index=VIDEO_TOKEN_ID, audio_token_index=AUDIO_TOKEN_ID,
            tie_word_embeddings=False, **MARKER_IDS)
    text = {**text, "head_dim": HIDDEN // HEADS, "moe_intermediate_size": HIDDEN, "num_experts": 4,
            "num_experts_per_tok": 2}
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True}
    return Qwen3OmniMoeThinkerConfig(
        text_config=text, audio_config={**audio, "n_window": 50, "downsample_hidden_size": 16},
        vision_config={**vision, "patch_size": 16, "num_position_embeddings": 256, "deepstack_visual_indexes": [0]},
        image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID, audio_token_id=AUDIO_TOKEN_ID, **MARKER_IDS)


def tiny_omni_model(family: OmniFamily = "qwen2_5_omni", seed: int = 0) -> PreTrainedModel:
    """A tiny random-init Qwen-Omni thinker of `family` (fp32, eval mode)."""
    from transformers import AutoModelForImageTextToText

    if family not in OMNI_FAMILIES:
        raise ValueError(f"family={family!r}: tiny Omni thinkers come in {', '.join(OMNI_FAMILIES)}")
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(_config(family)).float().eval()


def build_tiny_omni(path: Path, family: OmniFamily = "qwen2_5_omni") -> Path:
    """A tiny Qwen-Omni thinker folder with the tiny-char tokenizer, its vocabulary padded with
    unused tokens so the thinker's marker tokens land on the model's ids: a model `rlx train` can run."""
    from rlx.models.tiny import char_tokenizer

    tokenizer = char_tokenizer()
    unused = [f"<|unused{i}|>" for i in range(VISION_START_ID - len(tokenizer))]
    tokenizer.add_special_tokens({"additional_special_tokens": [*unused, *MARKERS]})
    ids = tokenizer.convert_tokens_to_ids(list(MARKERS))
    assert ids == list(range(VISION_START_ID, VOCAB_SIZE)) and len(tokenizer) == VOCAB_SIZE, ids
    model = tiny_omni_model(family)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD_ID, EOS_ID
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
