"""Fields of scope `group` (a prompt's media inputs) are stored once per group on the bus and read
by each of its rows; they leave with the group's last row, or when the group is abandoned."""

from __future__ import annotations

import torch

from rlx.bus.core import BusIndex
from rlx.bus.local import LocalBus

MEDIA = {"pixel_values": torch.ones(2, 3, 8, 8)}


def _group(bus: LocalBus, group_id: int, rows: int, put: int | None = None) -> list[int]:
    bus.put_group(group_id, {"media_inputs": MEDIA}, rows=rows)
    count = rows if put is None else put
    return bus.put({"response_ids": [[i] for i in range(count)]}, group_ids=[group_id] * count)


def test_every_row_reads_the_one_stored_object_and_it_leaves_with_the_last_row():
    bus = LocalBus()
    rows = _group(bus, 7, rows=4)
    assert len(bus.index.group_values) == 1 and all("media_inputs" not in bus.index.rows[r].values for r in rows)
    taken, values = bus.get("train", ["response_ids", "media_inputs"], 4, timeout=1)
    assert taken == rows and all(v is values["media_inputs"][0] for v in values["media_inputs"])
    bus.clear(rows[:3])
    assert 7 in bus.index.group_values  # one row still reads it
    bus.clear(rows[3:])
    assert bus.index.group_values == {} and bus.index.group_rows == {}


def test_a_row_waits_for_its_group_fields_and_rows_still_to_come_keep_them():
    bus = LocalBus()
    early = bus.put({"response_ids": [[1]]}, group_ids=[3])
    assert bus.poll("train", ["response_ids", "media_inputs"], 1, timeout=0.05) == ([], {})
    missing = bus.index.missing_fields("train", ["response_ids", "media_inputs"])
    assert missing == {"media_inputs": 1}
    bus.put_group(3, {"media_inputs": MEDIA}, rows=2)
    assert bus.poll("train", ["response_ids", "media_inputs"], 1, timeout=1)[0] == early
    bus.clear(early)  # the group's second row is not here yet: its fields stay for it
    assert 3 in bus.index.group_values
    late = bus.put({"response_ids": [[2]]}, group_ids=[3])
    assert bus.get("train", ["media_inputs"], 1, timeout=1)[1]["media_inputs"][0] is MEDIA
    bus.clear(late)
    assert bus.index.group_values == {}


def test_an_abandoned_group_drops_its_fields_and_snapshots_keep_them():
    bus = LocalBus()
    _group(bus, 1, rows=2, put=1)  # its producer died after one of two rows
    kept = _group(bus, 2, rows=2)
    assert bus.abandon_incomplete_groups([1, 2], group_size=2) == [1]
    assert set(bus.index.group_values) == {2}
    state = BusIndex.resumable(bus.index.snapshot(), drop_groups=[], outputs={})
    restored = BusIndex.restore(state)
    assert restored.values(kept, ["media_inputs"])["media_inputs"] == [MEDIA, MEDIA]
    restored.clear(kept)
    assert restored.group_values == {} and restored.group_rows == {}
    assert BusIndex.resumable(bus.index.snapshot(), drop_groups=[2], outputs={})["group_values"] == {}
