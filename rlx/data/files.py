"""Prompt rows from JSONL and Parquet files; every bad row is reported, none is skipped silently.

Whatever is wrong with a record becomes one line of a single report that names the file and the
line (Parquet: the row), and the rest of the file is still read: bytes that are not UTF-8, JSON
that does not parse, a number with more digits than Python converts, nesting too deep to parse,
a Parquet file or row group that cannot be decoded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlx.data.rows import DataError, PromptRow, listing, validate_row

if TYPE_CHECKING:
    from rlx.config import MediaLimits


def _decode(raw: bytes, number: int) -> str:
    try:
        return raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a byte-order mark may open the file
    except UnicodeDecodeError as exc:
        raise DataError(f"byte {exc.start + 1} ({raw[exc.start:exc.start + 1]!r}) is not UTF-8; "
                        "save the file as UTF-8") from None


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise DataError("JSON nested too deeply to parse; flatten the record") from None
    except ValueError as exc:  # Python's limit on the digits of an int read from text
        reason = str(exc).split(":")[0]  # "Exceeds the limit (4300 digits) for integer string conversion"
        raise DataError(f"a number is too long to read ({reason}); write it as a string") from None


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as handle:  # bytes: a line that is not UTF-8 is reported, not fatal to the file
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            try:
                yield where, _parse_json(_decode(raw, number))
            except DataError as exc:
                yield where, DataError(f"{where}: {exc}")


def _arrow_reason(exc: Exception) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    """Row group by row group: a corrupt one is reported (with its rows) and the others still load."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    unreadable = (pa.ArrowException, OSError, ValueError)
    try:
        parquet = pq.ParquetFile(path)
    except unreadable as exc:
        yield str(path), DataError(f"{path}: not a readable Parquet file ({_arrow_reason(exc)}); "
                                   "re-export it, or set data.source to the file's real format")
        return
    first = 1
    for group in range(parquet.num_row_groups):
        count = parquet.metadata.row_group(group).num_rows
        where = f"{path}:rows {first}-{first + count - 1}"
        try:
            records = parquet.read_row_group(group).to_pylist()
        except unreadable as exc:
            yield where, DataError(f"{where}: row group {group} is corrupt ({_arrow_reason(exc)}); "
                                   "re-export the file")
        else:
            for offset, record in enumerate(records):
                yield f"{path}:row {first + offset}", record
        first += count


def load_rows(path: str | Path, fmt: str, prompt_key: str, label_key: str, metadata_key: str,
              media_keys: Mapping[str, str] | None = None, limits: MediaLimits | None = None) -> list[PromptRow]:
    """Load every row, or raise one DataError listing the bad rows (file and line of each). Media
    paths in the rows resolve from the file's folder (see validate_row)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data file {str(path)!r} does not exist (check data.path / data.eval_path)")
    records = _jsonl_records(path) if fmt == "jsonl" else _parquet_records(path)
    rows, errors = [], []
    for where, record in records:
        try:
            if isinstance(record, DataError):
                raise record
            rows.append(validate_row(record, where, prompt_key, label_key, metadata_key, media_keys, limits,
                                     path.parent))
        except DataError as exc:
            errors.append(str(exc))
    if errors:
        raise DataError(f"{len(errors)} malformed row(s) in {path}; the run does not start:{listing(errors)}")
    if not rows:
        raise DataError(f"data file {path} holds no rows")
    return rows
