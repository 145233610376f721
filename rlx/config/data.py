"""The `data` section: where prompt rows come from, the media they may carry, and the bounds on it.

The modalities are declared here, once: `rlx.media` (a layer above) imports them, so a new kind
of media starts with a name in `MediaKind`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from pydantic import Field, PrivateAttr, field_validator, model_validator

from rlx.config.base import Section

if TYPE_CHECKING:
    from rlx.config.run import RunConfig

MediaKind = Literal["image", "audio", "video"]
MEDIA_MODALITIES: tuple[MediaKind, ...] = get_args(MediaKind)
AUDIO_SAMPLING_RATE = 16_000  # Hz: Whisper's and Relax's
DIGITS_EVAL_SIZE = 500  # the digits' held-out default: 500 of its 1797 images
SPOKEN_CACHE_DIR = Path.home() / ".cache" / "rlx" / "data" / "spoken_digits"  # its clips; its default media root
BUILT_IN_SIZES = {"digits": {"eval_size": DIGITS_EVAL_SIZE},  # defaults where the source's own suit it better
                  "spoken_digits": {"train_size": 1000, "eval_size": 300}}  # a clip is ~50 KB, made once
MEDIA_SOURCES = ("digits", "spoken_digits")  # built-in sources whose rows carry media without data.media_keys


class MediaLimits(Section):
    """Bounds on the untrusted media data rows point to, checked before anything is decoded."""

    max_pixels: int = Field(16_777_216, gt=0, description="largest image (width x height), read from its header")
    max_bytes: int = Field(50_000_000, gt=0, description="largest encoded media file or inline bytes")
    max_frames: int = Field(768, gt=0, description="most frames a video yields: caps data.video.max_frames; "
                            "a frame array with more is refused")
    max_seconds: float = Field(600.0, gt=0, description="longest audio or video, read from its header before "
                               "decoding")
    root: str | None = Field(None, description="media paths must resolve (symlinks followed) inside this folder; "
                             "default: the folder of data.path")
    _data_dir: str | None = PrivateAttr(None)  # set by DataConfig: the default root

    @field_validator("root")
    @classmethod
    def _absolute(cls, root: str | None) -> str | None:
        """Absolute once, here: a process started in another working directory checks the same folder."""
        return None if root is None else str(Path(root).expanduser().resolve())

    @property
    def root_dir(self) -> Path:
        """The folder media paths must stay in: `root`, else data.path's folder, else the working directory."""
        return Path(self.root or self._data_dir or ".").resolve()


class VideoSampling(Section):
    """Frames taken from a video file: `fps` frames per second of video time, at least `min_frames`
    and at most `max_frames`, spread uniformly over the video (Qwen-VL's and Relax's defaults)."""

    fps: float = Field(2.0, gt=0, description="frames per second of video time")
    min_frames: int = Field(4, gt=0, description="frames of a short video, however short")
    max_frames: int = Field(768, gt=0, description="frames of a long video, however long (and at most "
                            "data.media_limits.max_frames)")

    @model_validator(mode="after")
    def _ordered(self) -> VideoSampling:
        if self.min_frames > self.max_frames:
            raise ValueError(f"data.video.min_frames={self.min_frames} is more than data.video.max_frames="
                             f"{self.max_frames}; lower min_frames or raise max_frames")
        return self


class DataConfig(Section):
    source: Literal["reasoning_gym", "jsonl", "parquet", "digits", "spoken_digits"] = Field(
        "reasoning_gym", description="digits: scikit-learn's 1797 8x8 digit images (pip install 'rlx[media]'); "
        "spoken_digits: numbers spoken by espeak-ng, held-out voices in eval (task_params: {task: digit|sum})")
    task: str = Field("chain_sum", description="reasoning-gym task name when source=reasoning_gym")
    task_params: dict[str, Any] = Field(default_factory=dict)
    train_size: int = Field(5000, gt=0)
    eval_size: int = Field(128, ge=0)
    path: str | None = Field(None, description="train file for jsonl/parquet")
    eval_path: str | None = Field(None, description="held-out file for jsonl/parquet")
    prompt_key: str = "prompt"
    label_key: str = "label"
    metadata_key: str = "metadata"
    system_prompt: str | None = None
    apply_chat_template: bool = True
    max_prompt_tokens: int = Field(512, gt=0)
    seed: int = 0
    media_keys: dict[str, str] = Field(default_factory=dict, description="modality -> row key of its media, e.g. "
                                       "{image: images}; empty: text-only rows")
    media_limits: MediaLimits = Field(default_factory=MediaLimits)
    video: VideoSampling = Field(default_factory=VideoSampling)
    image_pixels: tuple[int, int] | None = Field(
        None, description="(min, max) pixels an image is resized into before patching (Qwen-VL's smart resize; "
        "each side a multiple of patch x merge); default: the model family's (Qwen2/2.5-VL 3136-1003520, "
        "Qwen3-VL 65536-16777216). More pixels: more image tokens")
    audio_sampling_rate: int = Field(AUDIO_SAMPLING_RATE, gt=0, description="audio is resampled to this rate (Hz), mono")
    processor_workers: int = Field(0, ge=0, description="processes per rollout replica that decode and process "
                                   "media, the groups a step starts in parallel; 0: on the rollout's own thread")

    @model_validator(mode="before")
    @classmethod
    def _built_in_sizes(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and raw.get("source") in BUILT_IN_SIZES:
            return {**BUILT_IN_SIZES[raw["source"]], **raw}
        return raw

    @field_validator("image_pixels")
    @classmethod
    def _pixel_bounds(cls, bounds: tuple[int, int] | None) -> tuple[int, int] | None:
        if bounds is not None and not 0 < bounds[0] <= bounds[1]:
            raise ValueError(f"data.image_pixels={list(bounds)} must be [min, max] with 0 < min <= max")
        return bounds

    @field_validator("media_keys")
    @classmethod
    def _known_modalities(cls, keys: dict[str, str]) -> dict[str, str]:
        for modality, key in keys.items():
            if modality not in MEDIA_MODALITIES:
                raise ValueError(f"{modality!r} is not a modality; use {', '.join(MEDIA_MODALITIES)}")
            if not key:
                raise ValueError(f"the row key of {modality!r} is empty; name the field that holds its media")
        return keys

    @model_validator(mode="after")
    def _file_sources_need_a_path(self) -> DataConfig:
        if self.source in ("jsonl", "parquet") and not self.path:
            raise ValueError(f"data.path is required when data.source={self.source!r}; set data.path=<file>")
        return self

    @property
    def has_media(self) -> bool:
        """Rows carry media: the run needs a media processor and the bus a media field."""
        return bool(self.media_keys) or self.source in MEDIA_SOURCES

    @model_validator(mode="after")
    def _default_media_root(self) -> DataConfig:
        """Media paths default to staying beside the data file, or in spoken_digits' cache (its clips are
        made under the root); absolute, like `root` (see MediaLimits)."""
        if self.source == "spoken_digits":
            self.media_limits._data_dir = str(SPOKEN_CACHE_DIR.resolve())
        else:
            self.media_limits._data_dir = str(Path(self.path).parent.resolve()) if self.path else None
        return self


def conflicts(c: RunConfig) -> list[str]:
    """Media rows against the roles that would carry them."""
    problems = []
    if c.data.has_media and c.rollout.engine != "hf":
        problems.append(f"media rows (data.media_keys / data.source={c.data.source}) go through rlx's own processor "
                        f"into the hf engine only; rollout.engine={c.rollout.engine} takes text: set rollout.engine=hf")
    if c.data.has_media and c.rollout.agent_app is not None:
        problems.append("an agent app's calls carry text only: unset rollout.agent_app (rollout.agent takes a row's "
                        "media into its trajectories), or drop data.media_keys")
    return problems
