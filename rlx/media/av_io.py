"""Audio and video containers opened safely with PyAV: every input is untrusted.

Only the demuxers named here run (FFmpeg's others include playlists and concat lists that open
further files), the encoded bytes are held in memory (already bounded by max_bytes), and the
duration comes from the header, so a long file is refused before any frame is decoded.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from rlx.errors import DataError

if TYPE_CHECKING:
    import av.container
    import av.stream

    from rlx.config import MediaLimits

VIDEO_CONTAINERS = ("mov", "matroska", "avi")  # .mp4 .mov .m4v, .mkv .webm, .avi
AUDIO_CONTAINERS = ("wav", "mp3", "ogg", "flac", "aac", "mov", "matroska")  # + .m4a, .mka/.webm, audio of videos


def open_container(data: bytes, formats: tuple[str, ...], where: str, what: str) -> av.container.InputContainer:
    """The bytes as a PyAV input container read by one of `formats` (FFmpeg demuxer names)."""
    try:
        import av
    except ModuleNotFoundError:
        raise ImportError("decoding audio and video needs PyAV: pip install 'rlx[media]'") from None
    try:
        return av.open(io.BytesIO(data), options={"format_whitelist": ",".join(formats)})
    except av.FFmpegError as exc:
        raise DataError(f"{where}: {what} is not in a container rlx reads (FFmpeg demuxers {', '.join(formats)}): "
                        f"{exc.strerror or exc}") from None


def declared_seconds(container: av.container.InputContainer, stream: av.stream.Stream) -> float | None:
    """The stream's duration from the header (the container's when the stream has none), or None."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000  # FFmpeg's AV_TIME_BASE: microseconds
    return None


def check_seconds(seconds: float, limits: MediaLimits, where: str, what: str) -> None:
    if seconds > limits.max_seconds:
        raise DataError(f"{where}: {what} lasts {seconds:.1f} s, more than data.media_limits.max_seconds="
                        f"{limits.max_seconds:g}; raise data.media_limits.max_seconds or cut the file")


def corrupt(where: str, what: str, reason: object) -> DataError:
    """The error for a container that opened but whose frames do not decode; `reason` a text or an FFmpegError."""
    text = getattr(reason, "strerror", None) or reason  # FFmpeg's words, without its errno and call name
    return DataError(f"{where}: {what} is corrupt and cannot be decoded ({' '.join(str(text).split())}); "
                     "re-encode the file")
