"""The spoken_digits source: numbers spoken by the real espeak-ng, held-out voices, cached clips, and its errors."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from rlx.config import SPOKEN_CACHE_DIR, DataConfig
from rlx.data import load_splits
from rlx.data.spoken import HELD_OUT_VOICES, PROMPTS, TRAIN_VOICES, spoken_splits
from rlx.errors import DataError
from rlx.media.audio import load_audio

needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs espeak-ng: make install")

RATE = 16_000


def config(root: Path, **fields) -> DataConfig:
    return DataConfig(source="spoken_digits", media_limits={"root": str(root)}, **fields)


def clip_path(row) -> Path:
    return Path(row.media["audio"][0].path)


def spoken(text: str, row, out: Path) -> bytes:
    """What espeak-ng itself makes of `text` in the row's voice, speed and pitch."""
    meta = row.metadata
    subprocess.run(["espeak-ng", "-a", "100", "-g", "0", "-v", meta["voice"], "-s", str(meta["speed"]),
                    "-p", str(meta["pitch"]), "-w", str(out), text], check=True)
    return out.read_bytes()


@pytest.fixture(scope="module")
def digit_splits(tmp_path_factory):
    root = tmp_path_factory.mktemp("spoken")
    cfg = config(root, train_size=40, eval_size=30)
    return cfg, *load_splits(cfg)


def test_config_defaults_for_the_source(tmp_path):
    cfg = DataConfig(source="spoken_digits")
    assert (cfg.train_size, cfg.eval_size) == (1000, 300) and cfg.has_media
    assert cfg.media_limits.root_dir == SPOKEN_CACHE_DIR.resolve()  # the cache is the media root
    assert config(tmp_path, eval_size=8).eval_size == 8  # given sizes win over the source's defaults
    assert config(tmp_path).media_limits.root_dir == tmp_path.resolve()


@needs_espeak
def test_splits_are_sized_in_disjoint_voices_and_a_prefix_when_smaller(digit_splits, tmp_path):
    cfg, train, held_out = digit_splits
    assert (len(train), len(held_out)) == (40, 30)
    train_voices = {row.metadata["voice"] for row in train}
    held_voices = {row.metadata["voice"] for row in held_out}
    assert train_voices == set(TRAIN_VOICES) and held_voices == set(HELD_OUT_VOICES)
    assert not train_voices & held_voices
    accents = {voice.split("+")[0] for voice in train_voices}  # eval hears neither a train accent nor variant
    assert not accents & {voice.split("+")[0] for voice in held_voices}
    for split in (train, held_out):
        assert len({clip_path(row) for row in split}) == len(split)  # no clip twice within a split
        assert all(clip_path(row).is_relative_to(cfg.media_limits.root_dir) for row in split)
    small_train, small_held = spoken_splits(10, 12, 0, cfg.media_limits.root_dir, {})
    assert [r.metadata for r in small_held] == [r.metadata for r in held_out[:12]]
    assert [r.metadata for r in small_train] == [r.metadata for r in train[:10]]
    other_train, _ = spoken_splits(10, 0, 1, tmp_path, {})
    assert [r.metadata for r in other_train] != [r.metadata for r in small_train]


@needs_espeak
def test_labels_are_what_espeak_says(digit_splits, tmp_path):
    _, train, held_out = digit_splits
    assert train[0].prompt == PROMPTS["digit"] and train[0].prompt.count("<audio>") == 1
    assert sorted({row.label for row in train + held_out}) == [str(d) for d in range(10)]
    for index, row in enumerate((train[0], train[7], held_out[3])):  # the clip is espeak-ng reading the label
        assert clip_path(row).read_bytes() == spoken(row.label, row, tmp_path / f"{index}.wav")
    _, sums = spoken_splits(1, 6, 0, tmp_path / "sums", {"task": "sum"})
    assert sums[0].prompt == PROMPTS["sum"]
    for index, row in enumerate(sums[:3]):
        first, second = row.metadata["text"].split(" plus ")
        words = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
        a, b = words.index(first), words.index(second)
        assert row.label == str(a + b)
        assert clip_path(row).read_bytes() == spoken(f"{a} plus {b}", row, tmp_path / f"sum{index}.wav")


@needs_espeak
def test_every_clip_decodes_to_plausible_speech(digit_splits, tmp_path):
    digits_cfg, train, held_out = digit_splits
    sums_cfg = config(tmp_path, train_size=20, eval_size=20, task_params={"task": "sum"})
    for cfg, rows in ((digits_cfg, train + held_out), (sums_cfg, [r for split in load_splits(sums_cfg) for r in split])):
        for row in rows:  # measured: digits 0.48-1.2 s, sums 0.93-2.1 s; RMS 0.04-0.16
            samples = load_audio(row.media["audio"][0], cfg.media_limits, row.source, RATE)
            assert 0.3 <= samples.size / RATE <= 3.0, row.source
            assert np.sqrt(np.mean(samples**2)) > 0.01 and np.abs(samples).max() > 0.1, row.source  # not silence


@needs_espeak
def test_clips_are_made_once_and_reused(tmp_path):
    root = tmp_path / "cache"
    train, held_out = spoken_splits(6, 6, 3, root, {"task": "sum"})
    paths = [clip_path(row) for row in train + held_out]
    stamps = [path.stat().st_mtime_ns for path in paths]
    again, again_held = spoken_splits(6, 6, 3, root, {"task": "sum"})
    assert [clip_path(row) for row in again + again_held] == paths
    assert [path.stat().st_mtime_ns for path in paths] == stamps  # not spoken again
    paths[2].unlink()  # a lost clip is made again, and only it
    spoken_splits(6, 6, 3, root, {"task": "sum"})
    assert paths[2].is_file() and [p.stat().st_mtime_ns for p in paths[3:]] == stamps[3:]
    assert not list(root.rglob("*.tmp"))  # every clip was renamed into place
    fresh, _ = spoken_splits(6, 0, 3, tmp_path / "fresh", {"task": "sum"})  # espeak-ng is deterministic
    assert [clip_path(row).read_bytes() for row in fresh] == [path.read_bytes() for path in paths[:6]]


@needs_espeak
def test_default_held_out_split_has_300_clips(tmp_path):
    _, held_out = load_splits(config(tmp_path, train_size=1))
    assert len({clip_path(row) for row in held_out}) == 300
    assert {row.metadata["voice"] for row in held_out} == set(HELD_OUT_VOICES)


def test_missing_espeak_names_the_fix(tmp_path, monkeypatch):
    # fault injection: a PATH without espeak-ng stands in for a machine that never installed it
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(DataError, match=r"needs espeak-ng.*`make install`.*`apt-get install espeak-ng`"):
        load_splits(config(tmp_path, train_size=2, eval_size=2))


def test_bad_task_params_are_refused(tmp_path):
    for params, match in (({"task": "product"}, "task='product'.*digit, sum"),
                          ({"prompt": "Which number?"}, "exactly one <audio>"),
                          ({"voices": ["en-us"]}, r"\['voices'\].*use task, prompt")):
        with pytest.raises(DataError, match=match):
            spoken_splits(1, 1, 0, tmp_path, params)
