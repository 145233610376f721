"""A tiny random-init Qwen2.5-Omni thinker (text, images, videos and audio) built from a config in code.

The vision tower keeps Qwen2.5-VL's patch geometry (patch 14, temporal patch 2, merge 2, windowed
attention) and the audio tower Whisper's 128 mel bins and 2 s attention windows, so rlx's processor is
exercised as for the released checkpoint while a forward runs in well under a second on CPU. The
seven media markers sit at the top of a 128-token vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

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


def tiny_omni_model(seed: int = 0) -> PreTrainedModel:
    """A tiny random-init Qwen2.5-Omni thinker (fp32, eval mode)."""
    from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    text = {"vocab_size": VOCAB_SIZE, "hidden_size": HIDDEN, "intermediate_size": HIDDEN * 2,
            "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "max_position_embeddings": 4096, "pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
            # M-RoPE splits the head's HIDDEN // HEADS // 2 = 8 frequencies between time, height and width
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": HIDDEN,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
              "fullatt_block_indexes": [1]}  # one windowed block, one full-attention block
    audio = {"num_mel_bins": 128, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
             "d_model": 32, "output_dim": HIDDEN, "n_window": 100, "max_source_positions": 1500}
    config = Qwen2_5OmniThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio,
        image_token_index=IMAGE_TOKEN_ID, video_token_index=VIDEO_TOKEN_ID, audio_token_index=AUDIO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID,
        audio_start_token_id=AUDIO_START_ID, audio_end_token_id=AUDIO_END_ID, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Qwen2_5OmniThinkerForConditionalGeneration(config).float().eval()


def build_tiny_omni(path: Path) -> Path:
    """A tiny Qwen2.5-Omni thinker folder with the tiny-char tokenizer, its vocabulary padded with
    unused tokens so the thinker's marker tokens land on the model's ids: a model `rlx train` can run."""
    from rlx.models.tiny import char_tokenizer

    tokenizer = char_tokenizer()
    unused = [f"<|unused{i}|>" for i in range(VISION_START_ID - len(tokenizer))]
    tokenizer.add_special_tokens({"additional_special_tokens": [*unused, *MARKERS]})
    ids = tokenizer.convert_tokens_to_ids(list(MARKERS))
    assert ids == list(range(VISION_START_ID, VOCAB_SIZE)) and len(tokenizer) == VOCAB_SIZE, ids
    model = tiny_omni_model()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD_ID, EOS_ID
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
