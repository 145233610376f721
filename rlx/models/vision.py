"""Vision-language models of the LLaVA architecture, built from a text model in code.

A LLaVA model is a vision tower whose patch features a projector maps into the language model's
embedding space; each feature replaces one `<image>` token of the prompt. rlx builds them from any
Llama-family text model: its weights are copied exactly (plus one embedding row, the mean of the
others, for the new `<image>` token), the tower and projector are new (seeded). The result is a
plain transformers folder (`LlavaForConditionalGeneration`) that reloads with the Auto classes.

The built-in `smollm2-135m-vision` puts a one-layer CLIP tower on SmolLM2-135M-Instruct, sized for
small images (8x8 pixels in 2x2 patches of 4x4: four image tokens per image): small enough to
train the tower and projector by RL on this CPU while the language model stays frozen
(`model.trainable`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rlx.models.folders import save_model_folder
from rlx.models.loading import load_pretrained
from rlx.models.text_weights import copy_text_weights

if TYPE_CHECKING:
    from transformers import LlavaForConditionalGeneration, PreTrainedModel, PreTrainedTokenizerBase

IMAGE_TOKEN = "<image>"
# the parameters a frozen-language-model run trains (`model.trainable`)
VISION_PARAMETERS = ("model.vision_tower.*", "model.multi_modal_projector.*")


@dataclass(frozen=True)
class VisionTower:
    """The CLIP tower's shape: `image_size // patch_size` squared image tokens per image."""

    image_size: int = 8
    patch_size: int = 4
    hidden: int = 128
    layers: int = 1
    heads: int = 4
    seed: int = 0


def add_vision_tower(text_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                     tower: VisionTower = VisionTower()) -> LlavaForConditionalGeneration:
    """A LLaVA model around `text_model` (weights copied); `tokenizer` gains the `<image>` token."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text_config = text_model.config.to_dict()
    text_config["vocab_size"] = len(tokenizer)
    vision_config = CLIPVisionConfig(
        hidden_size=tower.hidden, intermediate_size=tower.hidden * 2, num_hidden_layers=tower.layers,
        num_attention_heads=tower.heads, image_size=tower.image_size, patch_size=tower.patch_size, num_channels=3)
    config = LlavaConfig(
        vision_config=vision_config.to_dict(), text_config=text_config, image_token_index=image_token_id,
        image_seq_length=(tower.image_size // tower.patch_size) ** 2, vision_feature_layer=-1,
        vision_feature_select_strategy="default", projector_hidden_act="gelu",
        tie_word_embeddings=text_model.config.tie_word_embeddings)
    torch.manual_seed(tower.seed)
    model = LlavaForConditionalGeneration(config).float()
    copy_text_weights(text_model, model, len(tokenizer))
    model.generation_config = text_model.generation_config
    return model.eval()


def build_smollm2_vision(target: Path, text_folder: Path) -> Path:
    """The built-in `smollm2-135m-vision` folder (from the built-in SmolLM2, built on first use)."""
    text_model, tokenizer = load_pretrained(text_folder)
    return save_model_folder(add_vision_tower(text_model, tokenizer), tokenizer, target)


def build_tiny_vision(path: Path, tower: VisionTower = VisionTower()) -> Path:
    """A tiny LLaVA (the 2-layer `tiny-char` Llama and its character tokenizer) for tests."""
    from rlx.models.tiny import char_tokenizer, tiny_model

    tokenizer = char_tokenizer()
    text_model = tiny_model(len(tokenizer))
    text_model.generation_config.pad_token_id = tokenizer.pad_token_id
    model = add_vision_tower(text_model, tokenizer, tower)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
