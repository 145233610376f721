"""Prompt rows from JSONL and Parquet files; every bad row is reported, none is skipped silently."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlx.data.rows import DataError, PromptRow, validate_row

MAX_REPORTED = 10


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as exc:
                yield where, DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})")


def _parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    for number, record in enumerate(pq.read_table(path).to_pylist(), start=1):
        yield f"{path}:row {number}", record


def load_rows(path: str | Path, fmt: str, prompt_key: str, label_key: str, metadata_key: str) -> list[PromptRow]:
    """Load every row, or raise one DataError listing the bad rows (file and line of each)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data file {str(path)!r} does not exist (check data.path / data.eval_path)")
    records = _jsonl_records(path) if fmt == "jsonl" else _parquet_records(path)
    rows, errors = [], []
    for where, record in records:
        try:
            if isinstance(record, DataError):
                raise record
            rows.append(validate_row(record, where, prompt_key, label_key, metadata_key))
        except DataError as exc:
            errors.append(str(exc))
    if errors:
        shown = "\n  ".join(errors[:MAX_REPORTED])
        more = f"\n  ... and {len(errors) - MAX_REPORTED} more" if len(errors) > MAX_REPORTED else ""
        raise DataError(f"{len(errors)} malformed row(s) in {path}; the run does not start:\n  {shown}{more}")
    if not rows:
        raise DataError(f"data file {path} holds no rows")
    return rows
