"""A row's media, checked at load time: its values become MediaItems, and its placeholders must match them.

Only the cheap checks run here (paths exist and stay inside the media root, byte sizes, array
shapes and values); images are decoded later, by `rlx.media.loading.load_image`.

A row's media field holds a list of items, or one item that is not a list. An item is a path
(relative to the data file's folder), bytes (a Parquet binary), an object {"bytes": <base64 text
or bytes>} (JSONL; the {"bytes", "path"} structs of Hugging Face image columns too), or an array
(nested lists of numbers, or a numpy array). A single array still goes inside a list.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rlx.config import MEDIA_MODALITIES, MediaKind
from rlx.errors import DataError
from rlx.media.loading import MediaItem, checked_image_array, checked_path

if TYPE_CHECKING:
    from rlx.config import MediaLimits

Media = dict[str, tuple[MediaItem, ...]]


def row_media(raw: Mapping[str, Any], where: str, media_keys: Mapping[str, str], limits: MediaLimits,
              base_dir: Path) -> Media:
    """The row's items per modality (modalities without items left out)."""
    media: Media = {}
    for kind, key in media_keys.items():
        items = tuple(_item(kind, value, f"{where}: {key}[{index}]", limits, base_dir)
                      for index, value in enumerate(_as_list(raw.get(key))))
        if items:
            media[kind] = items
    return media


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, list):
        return value
    if isinstance(value, np.ndarray) and value.dtype == object:  # a list column read through pandas
        return list(value)
    return [value]


def _item(kind: MediaKind, value: Any, where: str, limits: MediaLimits, base_dir: Path) -> MediaItem:
    if isinstance(value, str):
        return MediaItem(kind, path=str(checked_path(base_dir / value, limits, where)))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return MediaItem(kind, data=_bounded(bytes(value), limits, where))
    if isinstance(value, dict):
        return _from_object(kind, value, where, limits, base_dir)
    if isinstance(value, (list, np.ndarray)):
        return MediaItem(kind, array=_array(kind, value, where, limits))
    raise DataError(f"{where}: a {kind} must be a path, bytes, {{'bytes': <base64>}} or an array of numbers, "
                    f"got {type(value).__name__}")


def _from_object(kind: MediaKind, value: dict, where: str, limits: MediaLimits, base_dir: Path) -> MediaItem:
    if not value.keys() <= {"bytes", "path"}:
        raise DataError(f"{where}: a {kind} object holds 'bytes' (base64) or 'path', got keys {sorted(value)}")
    data, path = value.get("bytes"), value.get("path")
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except binascii.Error as exc:
            raise DataError(f"{where}: 'bytes' is not valid base64 ({exc}); encode the file with base64") from None
    if isinstance(data, (bytes, bytearray)):
        return MediaItem(kind, data=_bounded(bytes(data), limits, where))
    if data is None and isinstance(path, str):
        return MediaItem(kind, path=str(checked_path(base_dir / path, limits, where)))
    raise DataError(f"{where}: a {kind} object needs 'bytes' (base64 text) or 'path' (text)")


def _bounded(data: bytes, limits: MediaLimits, where: str) -> bytes:
    if len(data) > limits.max_bytes:
        raise DataError(f"{where}: inline media of {len(data)} bytes is more than data.media_limits.max_bytes="
                        f"{limits.max_bytes}; raise data.media_limits.max_bytes or shrink it")
    return data


def _array(kind: MediaKind, value: Any, where: str, limits: MediaLimits) -> np.ndarray:
    try:
        array = np.asarray(value)
    except ValueError:  # ragged nested lists
        raise DataError(f"{where}: the {kind} array's nested lists have unequal lengths") from None
    if kind == "image":  # stored as its uint8 form: 8x smaller than JSON's int64, and load_image takes it as is
        array = checked_image_array(array, limits, where)
    elif not (np.issubdtype(array.dtype, np.number) and array.dtype != np.bool_):
        raise DataError(f"{where}: a {kind} array must hold numbers, got dtype {array.dtype}")
    array = array.copy()
    array.flags.writeable = False  # rows are shared across groups and steps; nothing may change their pixels
    return array


def check_placeholders(prompt: str | list[dict[str, str]], media: Media, where: str,
                       media_keys: Mapping[str, str]) -> None:
    """Each modality's `<kind>` placeholders in the prompt (all chat messages) must equal its items."""
    texts = [prompt] if isinstance(prompt, str) else [message["content"] for message in prompt]
    problems = []
    for kind in MEDIA_MODALITIES:
        marker, items = f"<{kind}>", len(media.get(kind, ()))
        marks = sum(text.count(marker) for text in texts)
        if marks == items:
            continue
        field = f"field {media_keys[kind]!r}" if kind in media_keys else f"no field (set data.media_keys.{kind})"
        problems.append(f"{marks} {marker} placeholder(s) in the prompt but {items} {kind} item(s) in {field}")
    if problems:
        raise DataError(f"{where}: {'; '.join(problems)}. Put one placeholder where each item goes, "
                        "as many as the row has items")
