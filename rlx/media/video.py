"""Video frames of a media item, sampled by time: Qwen-VL's and Relax's rule, decoded safely with PyAV.

Sampling rule (`sample_times`): a video of D seconds yields round(D * fps) frames, at least
`min_frames` and at most `max_frames` (itself capped by data.media_limits.max_frames), at the
uniform times k * D / n from its first frame (k = 0 .. n-1). At the rate's own count these are
0, 1/fps, 2/fps, ...; a video too long for max_frames is spread over its whole length more
sparsely, one too short for min_frames more densely. Each time takes the frame shown then (the
last frame whose timestamp is not after it), so a video with fewer frames than times repeats
frames, and the frames stay evenly spaced in time.

Safety: the duration (header) is checked against max_seconds and the frame size against
max_pixels before any frame is decoded; every decoded frame's size is checked again; decoding
stops at the last time sampled; a stream with more than MAX_SOURCE_FPS frames per second of its
declared duration (a header that understates it) is refused.

An array item is frames already sampled: [T, H, W, 3] of uint8 (or integers in 0..255, as JSON
lists load), taken as they are, at `data.video.fps`.

The result carries the time between two sampled frames, the rate actually sampled: what places a
video's temporal patches in time (Qwen2.5-VL and the Omni thinkers), so a clip that min_frames made
denser, or a long video that max_frames made sparser, keeps its true timeline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rlx.errors import DataError
from rlx.media.av_io import VIDEO_CONTAINERS, check_seconds, corrupt, declared_seconds, open_container
from rlx.media.loading import LOADERS, MediaItem, check_pixels, encoded

if TYPE_CHECKING:
    import av.container
    import av.video

    from rlx.config import MediaLimits, VideoSampling

MAX_SOURCE_FPS = 480  # above any camera's slow-motion rate
TIME_TOLERANCE = 1e-3  # seconds: a frame stamped this little after a sample time still counts as shown then


@dataclass(frozen=True)
class SampledVideo:
    frames: list[np.ndarray]  # uint8 RGB [H, W, 3]
    seconds_per_frame: float  # between two consecutive frames, as sampled


def sample_times(seconds: float, fps: float, min_frames: int, max_frames: int) -> np.ndarray:
    """The times (seconds from the first frame) frames are taken at; see the module's rule."""
    count = min(max(math.floor(seconds * fps + 0.5), min_frames), max_frames)
    return np.arange(count) * (seconds / count)


def load_video(item: MediaItem, limits: MediaLimits, where: str,
               sampling: VideoSampling | None = None) -> SampledVideo:
    """The item's frames, sampled as `sampling` (`data.video`; its defaults when None) says; an
    unsafe or undecodable item raises a DataError naming `where`."""
    from rlx.config import VideoSampling

    sampling = sampling or VideoSampling()
    if item.kind != "video":
        raise DataError(f"{where}: load_video decodes only videos, not {item.kind}; use "
                        f"{LOADERS[item.kind]}")
    if item.array is not None:
        return SampledVideo(_array_frames(np.asarray(item.array), limits, where), 1 / sampling.fps)
    data, what = encoded(item, limits, where)
    with open_container(data, VIDEO_CONTAINERS, where, what) as container:
        if not container.streams.video:
            raise DataError(f"{where}: {what} has no video stream")
        stream = container.streams.video[0]
        seconds = declared_seconds(container, stream)
        if seconds is None:
            raise DataError(f"{where}: {what} does not state its duration, so it cannot be sampled by time or "
                            "bounded before decoding; remux it to mp4 (ffmpeg -i IN -c copy OUT.mp4)")
        check_seconds(seconds, limits, where, what)
        check_pixels(stream.codec_context.width, stream.codec_context.height, limits, where, "video frame")
        times = sample_times(seconds, sampling.fps, sampling.min_frames, min(sampling.max_frames, limits.max_frames))
        frames = _frames_at(container, stream, times, seconds, limits, where, what)
        return SampledVideo(frames, seconds / len(times) if seconds > 0 else 1 / sampling.fps)


def _frames_at(container: av.container.InputContainer, stream: av.video.VideoStream, times: np.ndarray,
               seconds: float, limits: MediaLimits, where: str, what: str) -> list[np.ndarray]:
    """The frame shown at each time, decoding in order and stopping after the last time."""
    import av

    stream.thread_type = "AUTO"
    # FFmpeg itself refuses a frame over the limit, before allocating it: a stream whose resolution grows
    # past its header's would otherwise get up to FFmpeg's own limit (~268 Mpixel) per frame per thread
    stream.codec_context.options = {"max_pixels": str(limits.max_pixels)}
    most_decoded = math.ceil((seconds + 1) * MAX_SOURCE_FPS)
    frames: list[np.ndarray] = []
    shown: av.VideoFrame | None = None
    start = 0.0
    try:
        for index, frame in enumerate(container.decode(stream)):
            if index >= most_decoded:
                raise DataError(f"{where}: {what} holds more than {MAX_SOURCE_FPS} frames per second of its "
                                f"stated {seconds:.1f} s; its header is wrong, re-encode the file")
            if frame.time is None:
                raise DataError(f"{where}: {what} has frames without timestamps; remux it to mp4")
            check_pixels(frame.width, frame.height, limits, where, "video frame")
            if shown is None:
                start = frame.time
            elapsed = frame.time - start - TIME_TOLERANCE
            while shown is not None and len(frames) < len(times) and times[len(frames)] < elapsed:
                frames.append(shown.to_ndarray(format="rgb24"))  # `shown` was on screen at that time
            if len(frames) == len(times):
                break
            shown = frame
    except MemoryError:  # av's ENOMEM: max_pixels above (or a real shortage)
        raise DataError(f"{where}: {what} has a frame past data.media_limits.max_pixels={limits.max_pixels} "
                        "beyond what its header states (FFmpeg refused to decode it); raise "
                        "data.media_limits.max_pixels or re-encode the video at one size") from None
    except av.FFmpegError as exc:
        raise corrupt(where, what, exc) from None
    if shown is None:
        raise corrupt(where, what, "no video frame decoded")
    frames += [shown.to_ndarray(format="rgb24") for _ in range(len(times) - len(frames))]
    return frames


def _array_frames(array: np.ndarray, limits: MediaLimits, where: str) -> list[np.ndarray]:
    if array.ndim != 4 or array.shape[3] != 3 or 0 in array.shape:
        raise DataError(f"{where}: a video array must have shape [T, H, W, 3] (frames already sampled), "
                        f"got {list(array.shape)}")
    if not np.issubdtype(array.dtype, np.integer):  # bools are not integers here
        raise DataError(f"{where}: a video array must hold uint8 (0..255), got dtype {array.dtype}")
    if array.shape[0] > limits.max_frames:
        raise DataError(f"{where}: a video array of {array.shape[0]} frames is more than data.media_limits."
                        f"max_frames={limits.max_frames}; raise data.media_limits.max_frames or sample fewer frames")
    check_pixels(array.shape[2], array.shape[1], limits, where, "video frame")
    if array.dtype != np.uint8 and (array.min() < 0 or array.max() > 255):
        raise DataError(f"{where}: a video array must hold values in 0..255, got {array.min()}..{array.max()}")
    return list(array.astype(np.uint8))  # a fresh array: the caller's own, never a view of the item's
