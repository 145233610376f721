"""A prompt row: what every data source produces, whatever its file format."""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlx.data.media import check_placeholders, row_media
from rlx.errors import DataError
from rlx.media.loading import MediaItem

if TYPE_CHECKING:
    from rlx.config import MediaLimits

Messages = list[dict[str, str]]
MAX_REPORTED = 10  # problems listed in one error; the rest are counted


def _short_repr() -> reprlib.Repr:
    """A bad value is quoted in its error; a short, shallow quote keeps a huge or deeply nested one readable."""
    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother, short.maxlist, short.maxdict = 3, 80, 80, 4, 4
    return short


_QUOTE = _short_repr()


@dataclass(frozen=True)
class PromptRow:
    prompt: str | Messages
    label: str
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str = field(default="", compare=False)  # where it came from (file:line), for error messages
    # modality -> its items, in placeholder order; decoded lazily (rlx.media.loading.load_image)
    media: dict[str, tuple[MediaItem, ...]] = field(default_factory=dict, compare=False)

    @property
    def question(self) -> str:
        """The prompt as plain text: the text itself, or the last user message of a chat."""
        if isinstance(self.prompt, str):
            return self.prompt
        return next((m["content"] for m in reversed(self.prompt) if m.get("role") == "user"), "")


def quote(value: Any) -> str:
    """`repr(value)`, cut short: at most ~80 characters and 3 levels of nesting."""
    return _QUOTE.repr(value)


def listing(problems: list[str]) -> str:
    """The first MAX_REPORTED problems, one per indented line, and how many more there are."""
    shown = "".join(f"\n  {problem}" for problem in problems[:MAX_REPORTED])
    more = f"\n  ... and {len(problems) - MAX_REPORTED} more" if len(problems) > MAX_REPORTED else ""
    return shown + more


def validate_row(raw: Any, where: str, prompt_key: str, label_key: str, metadata_key: str,
                 media_keys: Mapping[str, str] | None = None, limits: MediaLimits | None = None,
                 base_dir: Path | None = None) -> PromptRow:
    """Turn one parsed record into a PromptRow or raise a DataError naming `where` (file:line).

    With `media_keys` (modality -> field), the row's media is checked too (rlx.data.media): paths
    resolve from `base_dir` (the data file's folder) and must stay inside `limits.root_dir`, and
    every modality's placeholders must match its items. Without it, rows are text-only and
    placeholders are left alone."""
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected an object with {prompt_key!r} and {label_key!r}, got {type(raw).__name__}")
    if prompt_key not in raw:
        raise DataError(f"{where}: missing field {prompt_key!r} (set data.prompt_key if it has another name)")
    if label_key not in raw:
        raise DataError(f"{where}: missing field {label_key!r} (set data.label_key if it has another name)")
    prompt = raw[prompt_key]
    if isinstance(prompt, list):
        bad = [m for m in prompt if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                                         and isinstance(m.get("content"), str))]
        if bad or not prompt:
            raise DataError(f"{where}: {prompt_key!r} must be text or a non-empty list of "
                            f"{{'role': str, 'content': str}} messages; bad entry: {quote(bad[:1] or prompt)}")
    elif not isinstance(prompt, str) or not prompt.strip():
        raise DataError(f"{where}: {prompt_key!r} must be non-empty text or chat messages, got {quote(prompt)}")
    label = raw[label_key]
    if label is None or isinstance(label, (dict, list)):
        raise DataError(f"{where}: {label_key!r} must be a scalar (text or number), got {quote(label)}")
    metadata = raw.get(metadata_key) or {}
    if not isinstance(metadata, dict):
        raise DataError(f"{where}: {metadata_key!r} must be an object, got {type(metadata).__name__}")
    if (path := _not_json(metadata, metadata_key)) is not None:
        raise DataError(f"{where}: {path} is not JSON data (str, number, bool, null, list, object): metadata travels "
                        "with every sample and into checkpoints; store it as a string or a number")
    media: dict[str, tuple[MediaItem, ...]] = {}
    if media_keys:
        if limits is None:
            from rlx.config import MediaLimits

            limits = MediaLimits()
        media = row_media(raw, where, media_keys, limits, base_dir or Path("."))
        check_placeholders(prompt, media, where, media_keys)
    return PromptRow(prompt=prompt, label=str(label), metadata=dict(metadata), source=where, media=media)


def _not_json(value: Any, path: str) -> str | None:
    """The path of the first value inside `value` that is not plain JSON data, or None."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{path} key {key!r}"
            if (found := _not_json(item, f"{path}.{key}")) is not None:
                return found
        return None
    if isinstance(value, list):
        return next((found for i, item in enumerate(value) if (found := _not_json(item, f"{path}[{i}]"))), None)
    return None if value is None or isinstance(value, (str, int, float)) else f"{path} ({type(value).__name__})"
