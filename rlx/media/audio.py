"""Audio of a media item as float32 mono samples in [-1, 1] at one rate (16 kHz: Whisper's and
Relax's), decoded and resampled safely with PyAV.

Channels are averaged into mono (librosa's `to_mono`, which Whisper-style pipelines use) after
FFmpeg's resampler brings them to the rate; the few samples a resampling filter overshoots past
±1 are clipped. The duration (header) is checked against max_seconds before decoding; a file
that states none, or understates it, is refused once its decoded samples run more than a second
past max_seconds.

An array item is samples already at the target rate: 1-D floats in [-1, 1] (convert int16 PCM
by dividing by 32768), taken as they are.
"""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from rlx.config import AUDIO_SAMPLING_RATE
from rlx.errors import DataError
from rlx.media.av_io import AUDIO_CONTAINERS, check_seconds, corrupt, declared_seconds, open_container
from rlx.media.loading import LOADERS, MediaItem, encoded

if TYPE_CHECKING:
    import av.audio
    import av.container

    from rlx.config import MediaLimits

PADDING_SECONDS = 1.0  # decoded audio may run past the header's duration by encoder padding


def load_audio(item: MediaItem, limits: MediaLimits, where: str,
               sampling_rate: int = AUDIO_SAMPLING_RATE) -> np.ndarray:
    """The item's samples, float32 mono [N] at `sampling_rate`; an unsafe or undecodable item
    raises a DataError naming `where` (the row's file:line)."""
    if item.kind != "audio":
        raise DataError(f"{where}: load_audio decodes only audio, not {item.kind}; use "
                        f"{LOADERS[item.kind]}")
    if item.array is not None:
        return _array_samples(np.asarray(item.array), limits, where, sampling_rate)
    data, what = encoded(item, limits, where)
    with open_container(data, AUDIO_CONTAINERS, where, what) as container:
        if not container.streams.audio:
            raise DataError(f"{where}: {what} has no audio stream")
        stream = container.streams.audio[0]
        seconds = declared_seconds(container, stream)
        if seconds is not None:
            check_seconds(seconds, limits, where, what)
        return _decoded_mono(container, stream, sampling_rate, limits, where, what)


def _decoded_mono(container: av.container.InputContainer, stream: av.audio.AudioStream, sampling_rate: int,
                  limits: MediaLimits, where: str, what: str) -> np.ndarray:
    import av

    resampler = av.AudioResampler(format="fltp", layout=None, rate=sampling_rate)  # planar: [channels, samples]
    most = int((limits.max_seconds + PADDING_SECONDS) * sampling_rate)
    chunks: list[np.ndarray] = []
    total = 0
    try:
        for frame in chain(container.decode(stream), [None]):  # None flushes the resampler
            for resampled in resampler.resample(frame):
                chunk = resampled.to_ndarray().mean(axis=0, dtype=np.float32)
                total += chunk.size
                if total > most:
                    raise DataError(f"{where}: {what} decodes to more than data.media_limits.max_seconds="
                                    f"{limits.max_seconds:g} s of audio (its header states less or nothing); "
                                    "raise data.media_limits.max_seconds or cut the file")
                chunks.append(chunk)
    except av.FFmpegError as exc:
        raise corrupt(where, what, exc) from None
    if not total:
        raise corrupt(where, what, "no audio sample decoded")
    return np.clip(np.concatenate(chunks), -1.0, 1.0)


def _array_samples(array: np.ndarray, limits: MediaLimits, where: str, sampling_rate: int) -> np.ndarray:
    if array.ndim != 1 or not array.size:
        raise DataError(f"{where}: an audio array must be 1-D mono samples at {sampling_rate} Hz, "
                        f"got shape {list(array.shape)}")
    if not np.issubdtype(array.dtype, np.floating):
        raise DataError(f"{where}: an audio array must hold floats in [-1, 1], got dtype {array.dtype} "
                        "(divide int16 PCM by 32768)")
    if not np.isfinite(array).all() or np.abs(array).max() > 1:
        raise DataError(f"{where}: an audio array must hold finite values in [-1, 1]")
    check_seconds(array.size / sampling_rate, limits, where, f"an audio array of {array.size} samples")
    return array.astype(np.float32)  # a fresh array: the caller's own, never a view of the item's
