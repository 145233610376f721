"""Built-in spoken task: numbers spoken by espeak-ng (offline), in voices the held-out split never hears in training.

Each row's audio is one clip: a number 0-9 (`task: digit`, label "7") or a sum of two such numbers
(`task: sum`, "seven plus two", label "9"), spoken at a seeded speed (130-200 words a minute) and
pitch (30-70 of espeak-ng's 0-99). Train speaks in TRAIN_VOICES, the held-out split in HELD_OUT_VOICES:
accents and voice variants eval never heard in training (issue #15: held-out voices in eval).

Row i of a split depends only on the seed and i, so a smaller split is a prefix of a larger one, and
no clip repeats within a split. Labels are the number as text: score them with reward.name=exact_match.

Clips are espeak-ng's WAV output (22.05 kHz 16-bit mono; load_audio resamples), cached under the media
root (data.media_limits.root, default SPOKEN_CACHE_DIR) in a folder keyed by a hash of espeak-ng's
version and flags, one file per (voice, speed, pitch, text), named by them: a clip is made once, by
a parallel espeak-ng process writing beside it and renaming (atomic), and reused by every split that
needs it. A few hundred clips take about a second on two cores.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlx.data.rows import DataError, PromptRow
from rlx.media.loading import MediaItem

TASKS = ("digit", "sum")
PROMPTS = {"digit": "<audio>\nWhich number is spoken in the audio? Answer:",
           "sum": "<audio>\nThe audio speaks a sum of two numbers. What is the sum? Answer:"}
TASK_PARAMS = ("task", "prompt")
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# language + espeak-ng variant; the held-out voices share neither accent nor variant with train's
TRAIN_VOICES = ("en-us", "en-gb+f3", "en-gb-scotland+m3", "en-029+f2", "en-gb-x-rp+m6")
HELD_OUT_VOICES = ("en-us-nyc+f4", "en-gb-x-gbclan+m5", "en-gb-x-gbcwmd+f5")
SPEEDS = (130, 200)  # words a minute, both ends drawn
PITCHES = (30, 70)  # of 0-99, espeak-ng's default 50
FLAGS = ("-a", "100", "-g", "0")  # amplitude, word gap: part of the cache key
MISSING = ("data.source=spoken_digits needs espeak-ng to speak its clips; install it with `make install` "
           "or `apt-get install espeak-ng`")


@dataclass(frozen=True)
class Clip:
    """One utterance as espeak-ng speaks it; its file name says everything that made it."""

    text: str
    voice: str
    speed: int
    pitch: int

    @property
    def name(self) -> str:
        return f"{self.voice}_s{self.speed}_p{self.pitch}_{self.text.replace(' ', '-')}.wav"


def spoken_splits(train_size: int, eval_size: int, seed: int, cache_root: Path,
                  task_params: dict[str, Any]) -> tuple[list[PromptRow], list[PromptRow]]:
    """(train, held-out) rows in disjoint voices, their clips made under `cache_root` if missing."""
    task, prompt = _task(task_params)
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        raise DataError(f"{MISSING} (no espeak-ng on PATH)")
    _check_voices(espeak, TRAIN_VOICES + HELD_OUT_VOICES)
    folder = Path(cache_root) / f"espeak-ng-{_engine_key(espeak)}"
    splits = [list(_rows(task, voices, size, np.random.default_rng([seed, part])))
              for part, (voices, size) in enumerate(((TRAIN_VOICES, train_size), (HELD_OUT_VOICES, eval_size)))]
    _render_missing(espeak, [clip for split in splits for clip, _ in split], folder)
    rows = [[_row(task, prompt, clip, label, folder, index, name) for index, (clip, label) in enumerate(split)]
            for split, name in zip(splits, ("train", "held-out"))]
    return rows[0], rows[1]


def _task(params: dict[str, Any]) -> tuple[str, str]:
    unknown = sorted(set(params) - set(TASK_PARAMS))
    if unknown:
        raise DataError(f"data.task_params has {unknown}, which data.source=spoken_digits does not take; "
                        f"use {', '.join(TASK_PARAMS)}")
    task = params.get("task", "digit")
    if task not in TASKS:
        raise DataError(f"data.task_params.task={task!r}; spoken_digits speaks one of {', '.join(TASKS)}")
    prompt = params.get("prompt", PROMPTS[task])
    if not isinstance(prompt, str) or prompt.count("<audio>") != 1:
        raise DataError(f"data.task_params.prompt={prompt!r} must hold exactly one <audio> placeholder")
    return task, prompt


def _rows(task: str, voices: Sequence[str], size: int, rng: np.random.Generator) -> Iterator[tuple[Clip, str]]:
    """`size` distinct (clip, label), voices in turn; each row's draws follow the last row's, so
    the rows of a smaller size are a prefix."""
    seen: set[Clip] = set()
    for index in range(size):
        clip, label = _draw(task, voices[index % len(voices)], rng)
        while clip in seen:
            clip, label = _draw(task, voices[index % len(voices)], rng)
        seen.add(clip)
        yield clip, label


def _draw(task: str, voice: str, rng: np.random.Generator) -> tuple[Clip, str]:
    numbers = [int(n) for n in rng.integers(0, 10, size=1 if task == "digit" else 2)]
    text = " plus ".join(WORDS[n] for n in numbers)
    speed, pitch = int(rng.integers(SPEEDS[0], SPEEDS[1] + 1)), int(rng.integers(PITCHES[0], PITCHES[1] + 1))
    return Clip(text, voice, speed, pitch), str(sum(numbers))


def _row(task: str, prompt: str, clip: Clip, label: str, folder: Path, index: int, split: str) -> PromptRow:
    metadata = {"dataset": "spoken_digits", "task": task, "split": split, "index": index, "text": clip.text,
                "voice": clip.voice, "speed": clip.speed, "pitch": clip.pitch}
    return PromptRow(prompt=prompt, label=label, metadata=metadata,
                     source=f"spoken_digits {split} row {index} ({clip.name})",
                     media={"audio": (MediaItem("audio", path=str(folder / clip.name)),)})


def _espeak_output(espeak: str, *args: str) -> str:
    done = subprocess.run([espeak, *args], capture_output=True, text=True, check=False)
    if done.returncode:
        raise DataError(f"data.source=spoken_digits: `espeak-ng {' '.join(args)}` failed with exit status "
                        f"{done.returncode} ({done.stderr.strip() or 'no message'}); check its install with "
                        "`espeak-ng --version`")
    return done.stdout


def _engine_key(espeak: str) -> str:
    """A clip changes with espeak-ng's version (and data folder) and the flags it is spoken with."""
    settings = _espeak_output(espeak, "--version") + repr(FLAGS)
    return hashlib.sha256(settings.encode()).hexdigest()[:12]


def _check_voices(espeak: str, voices: Sequence[str]) -> None:
    """espeak-ng falls back silently on an unknown variant, which would merge train's voices with eval's."""
    languages = {line.split()[1] for line in _espeak_output(espeak, "--voices=en").splitlines()[1:]}
    variants = {line.split()[-1].removeprefix("!v/")
                for line in _espeak_output(espeak, "--voices=variant").splitlines()[1:] if "!v/" in line}
    for voice in voices:
        language, _, variant = voice.partition("+")
        if language not in languages or (variant and variant not in variants):
            raise DataError(f"espeak-ng here has no voice {voice!r} (`espeak-ng --voices=en`, `--voices=variant`); "
                            "spoken_digits needs espeak-ng 1.51 or newer with its English voices")


def _render_missing(espeak: str, clips: Sequence[Clip], folder: Path) -> None:
    missing = sorted({clip for clip in clips if not (folder / clip.name).is_file()}, key=lambda c: c.name)
    if not missing:
        return
    folder.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=min(32, os.cpu_count() or 1)) as pool:
        list(pool.map(lambda clip: _render(espeak, clip, folder), missing))


def _render(espeak: str, clip: Clip, folder: Path) -> None:
    """Spoken into a file of its own beside the clip, then renamed: a reader never sees half a clip."""
    target = folder / clip.name
    partial = folder / f".{clip.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    try:
        _espeak_output(espeak, *FLAGS, "-v", clip.voice, "-s", str(clip.speed), "-p", str(clip.pitch),
                       "-w", str(partial), clip.text)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
