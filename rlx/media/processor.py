"""rlx's own media processor: a prompt row's media -> the model's inputs, placeholders expanded.

A dataset prompt holds one placeholder token per media item (`<image>`); the model wants as many
placeholder tokens as the item has features (Qwen-VL: inside vision start/end markers), and the
item's pixels in its own layout. The processor does both, once per prompt group (the rollout hands
the result to all of the group's samples). It is built from the model's config, never from
`AutoProcessor` (whose image and video processors need torchvision), so what it produces is checked
against the architecture itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from rlx.errors import DataError
from rlx.media.inputs import CLIP_MEAN, CLIP_STD, MediaInputs, expand_placeholders, media_token_ids
from rlx.media.positions import OMNI_MODEL_TYPES

if TYPE_CHECKING:
    from rlx.config import DataConfig, MediaLimits
    from rlx.data.rows import PromptRow
    from rlx.media.loading import MediaItem
    from rlx.media.video import SampledVideo

# a video item -> its sampled frames and the time between two of them
VideoLoader = Callable[["MediaItem", "MediaLimits", str], "SampledVideo"]
QWEN_VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
AUDIO_MODEL_TYPES = ("audioflamingo3",)
# the input that carries each video's seconds per temporal patch, where the family's positions use it
SECONDS_PER_GRID_INPUT = {"qwen2_5_vl": "second_per_grid_ts", "qwen2_5_omni_thinker": "video_second_per_grid",
                          "qwen3_omni_moe_thinker": "video_second_per_grid"}


class MediaProcessor(Protocol):
    placeholder_ids: dict[str, int]  # modality -> the token one item stands as in the prompt
    media_token_ids: tuple[int, ...]  # placeholders and markers: tokens only the processor may write
    limits: MediaLimits  # what media it reads: the same bounds for a row's and an environment's

    def __call__(self, prompt_ids: list[int], row: PromptRow) -> tuple[list[int], MediaInputs]:
        """The prompt's token ids with each placeholder expanded, and its media as model inputs."""


class LlavaImageProcessor:
    """Images for a LLaVA model: resized to its CLIP tower's square input (bicubic), scaled to
    [0, 1], normalised with CLIP's statistics; one placeholder becomes one token per patch feature
    (plus the class token's when the model keeps it: `vision_feature_select_strategy=full`)."""

    def __init__(self, config: Any, limits: MediaLimits) -> None:
        vision = config.vision_config
        self.size, self.limits = vision.image_size, limits
        self.image_token_id = config.image_token_id
        self.placeholder_ids = {"image": config.image_token_id}
        self.tokens_per_image = (vision.image_size // vision.patch_size) ** 2 + (
            config.vision_feature_select_strategy == "full")

    def pixels(self, image: np.ndarray) -> torch.Tensor:
        """[3, size, size] float32 from an RGB uint8 [H, W, 3] image."""
        from PIL import Image

        resized = np.asarray(Image.fromarray(image).resize((self.size, self.size), Image.Resampling.BICUBIC))
        scaled = resized.astype(np.float32) / 255.0
        normalised = (scaled - np.asarray(CLIP_MEAN, np.float32)) / np.asarray(CLIP_STD, np.float32)
        return torch.from_numpy(normalised.transpose(2, 0, 1).copy())

    def __call__(self, prompt_ids: list[int], row: PromptRow) -> tuple[list[int], MediaInputs]:
        from rlx.media.loading import load_image

        unsupported = sorted(kind for kind, items in row.media.items() if items and kind != "image")
        if unsupported:
            raise DataError(f"{row.source}: this model (LLaVA) reads images only; the row carries {unsupported}: "
                            "drop those data.media_keys or use a model that takes them")
        images = [load_image(item, self.limits, row.source) for item in row.media.get("image", ())]
        try:
            ids = expand_placeholders(prompt_ids, self.image_token_id, [self.tokens_per_image] * len(images),
                                      kind="image")
        except ValueError as exc:
            raise DataError(f"{row.source}: {exc}: each <image> in the prompt must stay one token after the chat "
                            "template (check the tokenizer has <image> as a special token)") from None
        if not images:
            return ids, {}
        return ids, {"pixel_values": torch.stack([self.pixels(image) for image in images])}


class QwenVLProcessor:
    """Images and videos for a Qwen-VL model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), as its own processor
    prepares them (rlx.media.qwen_vl): patches, grids, and each placeholder turned into the block the
    family's processor writes (vision start marker, one placeholder per merged patch, end marker).

    The prompt holds one image placeholder token (`<|image_pad|>`) per image and one video placeholder
    (`<|video_pad|>`) per video, alone or already between the vision start/end markers. Videos are read
    by `load_video` (default `rlx.media.video.load_video`), frames already sampled."""

    def __init__(self, config: Any, limits: MediaLimits, load_video: VideoLoader | None = None,
                 image_pixels: tuple[int, int] | None = None) -> None:
        """`load_video`: default `rlx.media.video.load_video` with its default sampling (the rate it
        sampled places a video's temporal patches in time: Qwen2.5-VL, Omni); `image_pixels`: (min,
        max) pixels of a resized image, default the family's."""
        from rlx.media.qwen_vl import QwenVisionSpec

        bounds = {"min_pixels": image_pixels[0], "max_pixels": image_pixels[1]} if image_pixels else {}
        self.spec = QwenVisionSpec.from_model_config(config, **bounds)
        self.limits, self._load_video = limits, load_video
        self.placeholder_ids = {"image": self.spec.image_token_id, "video": self.spec.video_token_id}
        self._seconds_input = SECONDS_PER_GRID_INPUT.get(config.model_type)

    def _video(self, item: MediaItem, where: str) -> SampledVideo:
        if self._load_video is None:
            from rlx.media.video import load_video

            self._load_video = load_video
        return self._load_video(item, self.limits, where)

    def __call__(self, prompt_ids: list[int], row: PromptRow) -> tuple[list[int], MediaInputs]:
        from rlx.media.loading import load_image
        from rlx.media.qwen_vl import expand_media, image_inputs, video_inputs

        unsupported = sorted(kind for kind, items in row.media.items() if items and kind not in ("image", "video"))
        if unsupported:
            raise DataError(f"{row.source}: this model ({self.spec.family}) reads images and videos; the row carries "
                            f"{unsupported}: drop those data.media_keys or use a model that takes them")
        images = [load_image(item, self.limits, row.source) for item in row.media.get("image", ())]
        videos = [self._video(item, row.source) for item in row.media.get("video", ())]
        try:
            inputs = {**(image_inputs(images, self.spec) if images else {}),
                      **(video_inputs([video.frames for video in videos], self.spec) if videos else {})}
        except ValueError as exc:  # an image or video the family refuses (aspect ratio, too few frames)
            raise DataError(f"{row.source}: {exc}") from None
        if videos and self._seconds_input:
            inputs[self._seconds_input] = torch.tensor([self.spec.temporal_patch_size * video.seconds_per_frame
                                                        for video in videos])
        try:
            ids = expand_media(prompt_ids, self.spec, inputs.get("image_grid_thw"), inputs.get("video_grid_thw"))
        except ValueError as exc:
            raise DataError(f"{row.source}: {exc}. Each <image> (<video>) of the prompt must reach the model as "
                            f"one token {self.spec.image_token_id} ({self.spec.video_token_id}), the model's "
                            "<|image_pad|> (<|video_pad|>)") from None
        return ids, inputs


def _check_whisper_rate(sampling_rate: int) -> None:
    from rlx.media.audio_features import SAMPLING_RATE

    if sampling_rate != SAMPLING_RATE:
        raise ValueError(f"data.audio_sampling_rate={sampling_rate}, but a Whisper encoder's features are "
                         f"defined at {SAMPLING_RATE} Hz: set data.audio_sampling_rate={SAMPLING_RATE}")


def whisper_windows(row: PromptRow, limits: MediaLimits, sampling_rate: int, n_mels: int, window_frames: int,
                    tokens: Callable[[int], int], split: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """Each audio clip of `row` (decoded at `sampling_rate`) as Whisper log-mel windows of
    `window_frames` frames, each with a mask of its real frames, and the clip's audio-token count
    (`tokens` of each window's real frames). A clip longer than one window is cut into windows
    when `split` (a tail too short for a token dropped), and refused otherwise."""
    from rlx.media.audio import load_audio
    from rlx.media.audio_features import HOP_LENGTH, SAMPLING_RATE, clip_windows, log_mel, real_frames

    features, masks, counts = [], [], []
    for index, item in enumerate(row.media.get("audio", ())):
        samples = load_audio(item, limits, row.source, sampling_rate)
        if not split and real_frames(samples.size) > window_frames:
            seconds = window_frames * HOP_LENGTH / SAMPLING_RATE
            raise DataError(f"{row.source}: audio clip {index} lasts {samples.size / sampling_rate:.1f} s, over the "
                            f"{seconds:.0f} s rlx gives a clip of this model: split it into clips of at most "
                            f"{seconds:.0f} s, each with its own <audio>")
        windows = clip_windows(samples, window_frames) if split else [samples]
        count = sum(tokens(real_frames(window.size)) for window in windows)
        if count < 1:
            raise DataError(f"{row.source}: audio clip {index} is too short for one audio token; drop it or pad it "
                            "with silence")
        for window in windows:
            features.append(log_mel(window, n_mels, window_frames))
            masks.append(torch.arange(window_frames) < real_frames(window.size))
        counts.append(count)
    return features, masks, counts


class WhisperAudioProcessor:
    """Audio for a Whisper-encoder audio-language model (AudioFlamingo3, e.g. the built-in
    smollm2-135m-audio): each clip decoded at 16 kHz (`load_audio`), cut into the encoder's windows
    (30 s for Whisper; a tail under 21 ms dropped), each window Whisper's log-mel features padded to
    the window (`input_features`) with a mask of its real frames (`input_features_mask`); one
    `<audio>` placeholder becomes the clip's audio tokens, as many as the encoder makes of its
    windows' real frames (25 per second: rlx.media.audio_features.encoder_tokens)."""

    def __init__(self, config: Any, limits: MediaLimits, sampling_rate: int) -> None:
        _check_whisper_rate(sampling_rate)
        self.limits, self.sampling_rate = limits, sampling_rate
        self.n_mels, self.frames = config.audio_config.num_mel_bins, 2 * config.audio_config.max_source_positions
        self.audio_token_id = config.audio_token_id
        self.placeholder_ids = {"audio": config.audio_token_id}

    def __call__(self, prompt_ids: list[int], row: PromptRow) -> tuple[list[int], MediaInputs]:
        from rlx.media.audio_features import encoder_tokens

        unsupported = sorted(kind for kind, items in row.media.items() if items and kind != "audio")
        if unsupported:
            raise DataError(f"{row.source}: this model (AudioFlamingo3) reads audio only; the row carries "
                            f"{unsupported}: drop those data.media_keys or use a model that takes them")
        features, masks, counts = whisper_windows(row, self.limits, self.sampling_rate, self.n_mels, self.frames,
                                                  encoder_tokens, split=True)
        try:
            ids = expand_placeholders(prompt_ids, self.audio_token_id, counts, kind="audio")
        except ValueError as exc:
            raise DataError(f"{row.source}: {exc}: each <audio> in the prompt must stay one token after the chat "
                            "template (check the tokenizer has <audio> as a special token)") from None
        if not features:
            return ids, {}
        return ids, {"input_features": torch.stack(features), "input_features_mask": torch.stack(masks).long()}


class QwenOmniProcessor:
    """Images, videos and audio for a Qwen-Omni thinker (Qwen2.5-Omni, Qwen3-Omni), as its own
    processor prepares them: images and videos as for the family's vision tower (Qwen2.5-VL's;
    Qwen3-VL's geometry for Qwen3-Omni), each video with its seconds per temporal patch
    (`video_second_per_grid`, which places its frames in time); each audio clip as Whisper log-mel
    features padded to one 30 s window (`input_features`, so clips of different rows stack) with a
    mask of its real frames (`feature_attention_mask`). Each placeholder is written between its
    markers (vision or audio start and end: the thinker finds its media by them); a clip stands for
    25 tokens per second (Qwen2.5-Omni) or 13 (Qwen3-Omni's chunked encoder)."""

    WINDOW_FRAMES = 3000  # 30 s of 10 ms frames: Qwen2.5-Omni's processor pads every clip to it

    def __init__(self, config: Any, limits: MediaLimits, load_video: VideoLoader | None = None,
                 image_pixels: tuple[int, int] | None = None, sampling_rate: int = 16_000) -> None:
        from rlx.media.audio_features import chunked_encoder_tokens, encoder_tokens

        _check_whisper_rate(sampling_rate)
        self.vision = QwenVLProcessor(config, limits, load_video, image_pixels)
        self.limits = limits
        self.n_mels = config.audio_config.num_mel_bins
        self.audio_token_id = config.audio_token_id
        markers = (getattr(config, "audio_start_token_id", None), getattr(config, "audio_end_token_id", None))
        if None in markers:
            raise ValueError(f"the {config.model_type} config names no audio_start_token_id / audio_end_token_id: "
                             "add them (the ids of <|audio_start|> and <|audio_end|> in its tokenizer)")
        self.audio_markers = markers
        self.placeholder_ids = {**self.vision.placeholder_ids, "audio": config.audio_token_id}
        n_window = config.audio_config.n_window
        self.audio_tokens = (encoder_tokens if config.model_type == "qwen2_5_omni_thinker"
                             else lambda frames: chunked_encoder_tokens(frames, n_window))

    def __call__(self, prompt_ids: list[int], row: PromptRow) -> tuple[list[int], MediaInputs]:
        from rlx.media.audio_features import SAMPLING_RATE

        seen = replace(row, media={kind: items for kind, items in row.media.items() if kind != "audio"})
        ids, inputs = self.vision(prompt_ids, seen)
        features, masks, counts = whisper_windows(row, self.limits, SAMPLING_RATE, self.n_mels, self.WINDOW_FRAMES,
                                                  self.audio_tokens, split=False)
        try:
            ids = expand_placeholders(ids, self.audio_token_id, counts, self.audio_markers, "audio")
        except ValueError as exc:
            raise DataError(f"{row.source}: {exc}: each <audio> in the prompt must stay one token "
                            f"({self.audio_token_id}, the model's <|AUDIO|>) after the chat template") from None
        if features:
            inputs |= {"input_features": torch.stack(features), "feature_attention_mask": torch.stack(masks).long()}
        return ids, inputs


def processor_for(config: Any, data: DataConfig) -> MediaProcessor:
    """The processor for a model's config (`transformers` config object), reading media within
    `data.media_limits` and sampling videos as `data.video` says; a clear error for a model rlx
    cannot feed media to."""
    processor = _processor_for(config, data)
    processor.media_token_ids = media_token_ids(config)
    return processor


def _processor_for(config: Any, data: DataConfig) -> MediaProcessor:
    if config.model_type == "llava":
        return LlavaImageProcessor(config, data.media_limits)
    if config.model_type in (*QWEN_VL_MODEL_TYPES, *OMNI_MODEL_TYPES):
        from rlx.media.video import load_video

        def sampled(item: MediaItem, limits: MediaLimits, where: str) -> SampledVideo:
            return load_video(item, limits, where, data.video)

        if config.model_type in OMNI_MODEL_TYPES:
            return QwenOmniProcessor(config, data.media_limits, sampled, data.image_pixels, data.audio_sampling_rate)
        return QwenVLProcessor(config, data.media_limits, sampled, data.image_pixels)
    if config.model_type in AUDIO_MODEL_TYPES:
        return WhisperAudioProcessor(config, data.media_limits, data.audio_sampling_rate)
    raise ValueError(f"model type {config.model_type!r} takes no media in rlx (data.media_keys is set): "
                     "supported are LLaVA models (e.g. the built-in smollm2-135m-vision), "
                     f"{', '.join(QWEN_VL_MODEL_TYPES)}, {', '.join(sorted(OMNI_MODEL_TYPES))} and "
                     f"{', '.join(AUDIO_MODEL_TYPES)} (e.g. the built-in smollm2-135m-audio)")
