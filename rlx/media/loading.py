"""Media items of data rows, and decoding them safely: every input is untrusted.

A path must resolve (symlinks followed) inside `MediaLimits.root_dir`; encoded bytes are bounded
by `max_bytes` before they are read whole, and pixels by `max_pixels` from the image header,
before any pixel is decoded. Every refusal is a DataError that names the row, the limit and the
config field that changes it.

Arrays are pixels already; `load_image` reads their values by this rule:
  - float arrays: values in [0, 1], scaled to 0..255 and rounded;
  - uint8 arrays: 0..255 as they are (a dark image stays dark);
  - other integer arrays (JSON nested lists become int64): values must lie in 0..255; when the
    largest is at most 16 they are read as the 0..16 scale of scikit-learn's digits and scaled
    by 255/16, otherwise taken as 0..255. Store a dark 0..255 image as uint8 (Parquet, .npy) or
    as floats to keep it from being scaled;
  - shapes [H, W] (grayscale), [H, W, 1], [H, W, 3] or [H, W, 4] (alpha dropped).
Decoded images are converted by Pillow's `convert("RGB")` (grayscale, palette, CMYK; alpha dropped).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rlx.config import MEDIA_MODALITIES, MediaKind
from rlx.errors import DataError

if TYPE_CHECKING:
    from rlx.config import MediaLimits

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # Pillow decoders tried; no others are exposed
DIGITS_SCALE_MAX = 16
LOADERS = {"image": "rlx.media.loading.load_image", "audio": "rlx.media.audio.load_audio",
           "video": "rlx.media.video.load_video"}  # one per kind, named in errors


@dataclass(frozen=True, eq=False)  # eq=False: arrays have no single truth value, so items compare by identity
class MediaItem:
    """One image, audio clip or video of a row: a file path (absolute once loaded), encoded bytes,
    or a decoded array. Exactly one of the three is set."""

    kind: MediaKind
    path: str | None = None
    data: bytes | None = None
    array: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.kind not in MEDIA_MODALITIES:
            raise ValueError(f"MediaItem.kind={self.kind!r}; use one of {', '.join(MEDIA_MODALITIES)}")
        given = [name for name in ("path", "data", "array") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"a MediaItem holds exactly one of path, data, array; got {given or 'none'}")


def checked_path(path: str | Path, limits: MediaLimits, where: str) -> Path:
    """`path` resolved (symlinks followed), refused outside the media root, missing, or too large.
    A relative path is taken from the working directory; rows resolve theirs from the data file."""
    root = limits.root_dir
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_relative_to(root):
        raise DataError(f"{where}: media path {str(path)!r} resolves to {resolved}, outside the media root {root}; "
                        "move the file under it or set data.media_limits.root to a folder that holds it")
    if not resolved.is_file():
        raise DataError(f"{where}: media file {str(path)!r} does not exist (resolved to {resolved})")
    check_bytes(resolved.stat().st_size, limits, where, f"media file {resolved}")
    return resolved


def check_bytes(size: int, limits: MediaLimits, where: str, what: str) -> None:
    if size > limits.max_bytes:
        raise DataError(f"{where}: {what} has {size} bytes, more than data.media_limits.max_bytes={limits.max_bytes}; "
                        "raise data.media_limits.max_bytes or shrink the file")


def check_pixels(width: int, height: int, limits: MediaLimits, where: str, what: str = "image") -> None:
    if width * height > limits.max_pixels:
        raise DataError(f"{where}: {what} of {width}x{height} = {width * height} pixels is larger than "
                        f"data.media_limits.max_pixels={limits.max_pixels}; raise data.media_limits.max_pixels "
                        f"or downscale the {what}")


def checked_image_array(array: np.ndarray, limits: MediaLimits, where: str) -> np.ndarray:
    """The array as uint8 [H, W, C] (C = 1, 3 or 4) by the module's value rule, or a DataError."""
    if array.dtype == np.bool_ or not (np.issubdtype(array.dtype, np.integer)
                                       or np.issubdtype(array.dtype, np.floating)):
        raise DataError(f"{where}: an image array must hold integers or floats, got dtype {array.dtype}")
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.shape[2] not in (1, 3, 4) or 0 in array.shape:
        raise DataError(f"{where}: an image array must have shape [H, W] or [H, W, 1|3|4], got {list(array.shape)} "
                        "(a row's single array still goes inside a list)")
    check_pixels(array.shape[1], array.shape[0], limits, where)
    if np.issubdtype(array.dtype, np.floating):
        if not np.isfinite(array).all() or array.min() < 0 or array.max() > 1:
            raise DataError(f"{where}: a float image array must hold values in [0, 1]; scale it, or store 0..255 "
                            "as integers")
        return np.rint(array * 255).astype(np.uint8)
    if array.dtype == np.uint8:
        return array
    low, high = int(array.min()), int(array.max())
    if low < 0 or high > 255:
        raise DataError(f"{where}: an integer image array must hold values in 0..255, got {low}..{high}")
    if high <= DIGITS_SCALE_MAX:
        return np.rint(array * (255 / DIGITS_SCALE_MAX)).astype(np.uint8)
    return array.astype(np.uint8)


def _rgb(array: np.ndarray) -> np.ndarray:
    channels = array.shape[2]
    rgb = np.repeat(array, 3, axis=2) if channels == 1 else array[:, :, :3]
    return rgb.copy()  # the caller's own: never a view of an item's (possibly read-only) array


def read_bounded(path: Path, limits: MediaLimits, where: str) -> bytes:
    with path.open("rb") as handle:  # at most max_bytes + 1: a file grown since its check is still refused
        data = handle.read(limits.max_bytes + 1)
    check_bytes(len(data), limits, where, f"media file {path}")
    return data


def encoded(item: MediaItem, limits: MediaLimits, where: str) -> tuple[bytes, str]:
    """A path or bytes item's encoded bytes, bounded by max_bytes, and the name its errors give it.
    Paths are checked against the root again here: a row loaded earlier may point at a file that has
    since changed."""
    if item.path is not None:
        path = checked_path(item.path, limits, where)
        return read_bounded(path, limits, where), f"{item.kind} file {path}"
    check_bytes(len(item.data), limits, where, f"inline {item.kind}")
    return item.data, f"inline {item.kind}"


def _decode_image(data: bytes, limits: MediaLimits, where: str, what: str) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)  # reads the header only
    except Image.DecompressionBombError as exc:
        raise DataError(f"{where}: {what} is a decompression bomb ({exc}); data.media_limits.max_pixels="
                        f"{limits.max_pixels} bounds the images accepted") from None
    except UnidentifiedImageError:
        raise DataError(f"{where}: {what} is not an image rlx decodes ({', '.join(IMAGE_FORMATS)})") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise DataError(f"{where}: {what} is not a decodable image ({' '.join(str(exc).split())}); "
                        f"rlx reads {', '.join(IMAGE_FORMATS)}") from None
    with image:
        check_pixels(image.width, image.height, limits, where)
        try:
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
        except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as exc:
            raise DataError(f"{where}: {what} is corrupt and cannot be decoded ({' '.join(str(exc).split())}); "
                            "re-export the image") from None


def load_image(item: MediaItem, limits: MediaLimits, where: str) -> np.ndarray:
    """The item's pixels as uint8 RGB [H, W, 3]; an unsafe or undecodable item raises a DataError
    naming `where` (the row's file:line)."""
    if item.kind != "image":
        raise DataError(f"{where}: load_image decodes only images, not {item.kind}; use "
                        f"{LOADERS[item.kind]}")
    if item.array is not None:
        return _rgb(checked_image_array(np.asarray(item.array), limits, where))
    data, what = encoded(item, limits, where)
    return _decode_image(data, limits, where, what)
