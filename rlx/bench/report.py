"""Write a benchmark's table into docs/benchmarks.md between its own markers, keeping the rest."""

from __future__ import annotations

import datetime
import platform
from pathlib import Path

import torch


def machine() -> str:
    import os

    return f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {platform.python_version()}"


def update_section(path: Path, name: str, command: str, body: str) -> None:
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    stamp = datetime.date.today().isoformat()
    section = f"{start}\n`{command}` ({stamp}; {machine()})\n\n{body}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if start in text and end in text:
        text = text[: text.index(start)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
