"""A real tiny colocated run with TensorBoard and W&B (offline) on: both hold exactly what
metrics.jsonl holds, W&B has the resolved config, no wandb process outlives the run, and
docs/metrics.md explains every key the run wrote."""

from __future__ import annotations

import json
import os
import re
import struct
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from rlx.config import build_config
from rlx.errors import ConfigError
from rlx.obs.metrics import read_metrics
from rlx.orchestration.colocate import run_colocate
from tests.integration.test_colocate_loop import toy_config

GLOSSARY = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


@pytest.fixture(scope="module")
def logged_run(tiny_path, tmp_path_factory):
    """Three steps with a reference (KL) and an evaluation mid-run, both sinks on; W&B kept offline
    and silent whatever the environment says."""
    tmp = tmp_path_factory.mktemp("sinks")
    config = toy_config(tiny_path, tmp, train__steps=3, train__eval_every=2, algorithm__kl_coef=0.1,
                        logging__tensorboard=True, logging__wandb={"enabled": True, "name": "sinks-test"})
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_SILENT", "true")
        env.setenv("WANDB_CACHE_DIR", str(tmp / "wandb-cache"))  # wandb-core's own log, not in ~/.cache
        env.setenv("WANDB_ERROR_REPORTING", "unset")  # recorded, so the context restores it afterwards ...
        env.delenv("WANDB_ERROR_REPORTING")  # ... after the sink turned it off, as offline runs do
        run_dir = run_colocate(config, echo=lambda _: None)
        assert os.environ["WANDB_ERROR_REPORTING"] == "false"
    leftover = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()]
    return run_dir, config, leftover


def expected_series(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for key, value in record.items():
            if key != "step":
                series.setdefault(key, []).append((record["step"], value))
    return series


def test_tensorboard_holds_every_jsonl_value(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    run_dir, _, _ = logged_run
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={SCALARS: 0})
    events.Reload()
    written = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    expected = expected_series(read_metrics(run_dir))
    assert sorted(written) == sorted(expected)
    for key, points in expected.items():
        assert [s for s, _ in written[key]] == [s for s, _ in points], key
        # event files store float32
        assert [v for _, v in written[key]] == pytest.approx([v for _, v in points], rel=1e-6, nan_ok=True), key


def wandb_records(path: Path) -> Iterator:
    """The protobuf records of a .wandb file. wandb 0.31 ships no Python reader (its Go core reads
    them), so this follows the format: a 7-byte header (':W&B', magic, version), then LevelDB-log
    chunks in 32 KiB blocks, each with a CRC-32 over its type byte and data, checked here."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    position, pending = 7, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a chunk header is padding
            position += block - position % block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 0 and length == 0:
            continue
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == checksum
        pending += chunk
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def test_wandb_offline_run_holds_every_jsonl_line_and_the_config(logged_run):
    run_dir, config, leftover = logged_run
    assert leftover == []  # close() finished the run and stopped wandb-core
    (wandb_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    records = list(wandb_records(wandb_file))
    rows, run_config = [], None
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
        elif kind == "run":
            assert record.run.display_name == "sinks-test"
            run_config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
    lines = read_metrics(run_dir)
    assert len(rows) == len(lines)
    for row, line in zip(rows, lines):
        row = {k: v for k, v in row.items() if not k.startswith("_")}  # wandb's own _step, _runtime, _timestamp
        assert row.keys() == line.keys(), line["step"]
        assert row == pytest.approx(line, nan_ok=True), line["step"]
    assert run_config["resolved"] == config.resolved()
    assert {k: v for k, v in run_config.items() if k not in ("_wandb", "resolved")} == config.model_dump(mode="json")


def glossary_patterns() -> list[re.Pattern]:
    """The keys of docs/metrics.md's tables; `<name>` stands for any part of a key."""
    keys = re.findall(r"^\| `([^`]+)` \|", GLOSSARY.read_text(), re.MULTILINE)
    return [re.compile("".join(".+" if part.startswith("<") else re.escape(part)
                               for part in re.split(r"(<[^>]+>)", key)) + "$") for key in keys]


def test_the_glossary_explains_every_key_the_run_wrote(logged_run):
    run_dir, _, _ = logged_run
    written = {key for record in read_metrics(run_dir) for key in record}
    patterns = glossary_patterns()
    missing = sorted(k for k in written if not any(p.match(k) for p in patterns))
    assert not missing, f"add these keys to docs/metrics.md: {missing}"
    assert len(written) > 40  # the run wrote the usual keys, so the check above had something to check


@pytest.mark.parametrize(("package", "logging", "field"), [
    ("wandb", {"wandb": {"enabled": True}}, "logging.wandb.enabled"),
    ("tensorboard", {"tensorboard": True}, "logging.tensorboard"),
])
def test_a_sink_without_its_package_is_a_config_error_naming_the_field_and_the_fix(monkeypatch, package, logging,
                                                                                     field):
    # fault injected: the package made unimportable, as on a machine without it
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(ConfigError, match=re.escape(f"{field} = True: Value error, {field}=true needs the {package} "
                                                    f"package: pip install 'rlx[logging]' (or pip install {package})")):
        build_config({"logging": logging})
    build_config({})  # off: nothing needed
