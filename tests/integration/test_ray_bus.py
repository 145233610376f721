"""The Ray-backed bus: values through the object store, the index in one actor, real waits."""

from __future__ import annotations

import pickle
import threading
import time

import pytest
import ray
import torch

from rlx.bus import BusTimeout
from rlx.bus.ray_bus import Bus
from rlx.bus.schema import SchemaError
from rlx.orchestration.cluster import start_ray, stop_ray
from rlx.orchestration.plan import FIELDS


@pytest.fixture(scope="module")
def bus():
    start_ray(num_cpus=4)
    yield Bus.create(capacity=8)
    stop_ray()


def test_fields_arrive_at_different_times_and_each_task_gets_a_row_once(bus):
    rows = bus.put({"response_ids": [torch.arange(3), torch.arange(5)]}, group_ids=[0, 0], num_tokens=[3, 5])
    with pytest.raises(BusTimeout) as timeout:
        bus.get("train", ["response_ids", "reward"], 2, timeout=0.3)
    message = str(timeout.value)
    assert "'train'" in message and "reward" in message and "0 ready" in message and "'reward': 2" in message
    bus.put_fields(rows, {"reward": [1.0, 0.0]})
    got, values = bus.get("train", ["response_ids", "reward"], 2, timeout=5)
    assert got == rows and values["reward"] == [1.0, 0.0]
    assert torch.equal(values["response_ids"][1], torch.arange(5))
    other, _ = bus.get("reward", ["response_ids"], 2, timeout=5)  # another task still sees them
    assert other == rows
    with pytest.raises(BusTimeout):
        bus.get("train", ["response_ids", "reward"], 1, timeout=0.2)
    bus.clear(rows)


def test_get_waits_for_a_producer_on_another_thread(bus):
    def produce_later():
        time.sleep(0.5)
        bus.put({"x": [1, 2]}, group_ids=[7, 7])

    thread = threading.Thread(target=produce_later)
    thread.start()
    start = time.monotonic()
    rows, values = bus.get("consumer", ["x"], 2, timeout=10, sampler=("group", 2))
    thread.join()
    assert values["x"] == [1, 2] and time.monotonic() - start >= 0.4
    bus.clear(rows)


def test_capacity_gives_back_pressure(bus):
    rows = bus.put({"x": list(range(8))}, group_ids=list(range(8)))
    bus.put({"x": [9]}, group_ids=[9], timeout=0.3)  # returns at once: writes do not wait for a reply
    with pytest.raises(BusTimeout, match="room"):  # the full bus made it wait 0.3 s, then fail
        bus.flush()
    bus.clear(rows)
    assert bus.metrics()["bus_rows"] == 0
    assert ray.is_initialized()


def test_writes_in_flight_apply_in_order_and_large_columns_go_through_the_object_store(bus):
    big = [torch.arange(20_000), torch.arange(10)]  # 160 kB: above the inline limit
    rows = bus.put({"ids": big}, group_ids=[1, 1], num_tokens=[20_000, 10])
    bus.put_fields(rows, {"reward": [1.0, 2.0]})  # sent before the put is confirmed
    consumer = pickle.loads(pickle.dumps(bus))  # another process's handle: no writes of its own
    got, values = consumer.get("train", ["ids", "reward"], 2, timeout=5)
    assert got == rows and values["reward"] == [1.0, 2.0]
    assert torch.equal(values["ids"][0], big[0]) and torch.equal(values["ids"][1], big[1])
    assert bus.snapshot()["rows"][0][3]["ids"].shape == (20_000,)  # snapshots hold values, not references
    bus.clear(rows)


def test_a_failed_write_is_raised_by_flush(bus):
    bus.put_fields([10**9], {"reward": [1.0]})  # a row that was never added
    with pytest.raises(Exception, match="never added"):
        bus.flush()


def test_snapshot_and_restore_keep_fields_and_consumption(bus):
    rows = bus.put({"response_ids": [[1, 2], [3]]}, group_ids=[4, 4], num_tokens=[2, 1])
    bus.put_fields(rows[:1], {"reward": [0.5]})
    assert bus.get("reward", ["response_ids"], 1, timeout=5)[0] == rows[:1]
    state = bus.snapshot()
    bus.clear(rows)
    bus.restore(state)
    got, values = bus.get("train", ["response_ids", "reward"], 1, timeout=5)
    assert got == rows[:1] and values == {"response_ids": [[1, 2]], "reward": [0.5]}
    again, _ = bus.get("reward", ["response_ids"], 1, timeout=5)  # consumption state survived
    assert again == rows[1:]
    bus.clear(rows)


def test_group_fields_are_one_object_for_all_rows_and_survive_a_snapshot(bus):
    media = {"pixel_values": torch.randn(64, 3, 32, 32)}  # 786 kB: through the object store
    bus.put_group(9, {"media_inputs": media}, rows=3)
    rows = bus.put({"response_ids": [[1], [2], [3]]}, group_ids=[9] * 3)
    got, values = bus.get("train", ["response_ids", "media_inputs"], 3, timeout=5)
    shared = values["media_inputs"]
    assert got == rows and torch.equal(shared[0]["pixel_values"], media["pixel_values"])
    assert shared[0] is shared[1] is shared[2]  # one object fetched once, not three copies
    state = bus.snapshot()
    assert torch.equal(state["group_values"][9]["media_inputs"]["pixel_values"], media["pixel_values"])
    bus.clear(rows)
    assert bus.snapshot()["group_values"] == {}  # gone with the group's last row
    bus.restore(state)
    _, again = bus.get("reward", ["media_inputs"], 3, timeout=5)
    assert torch.equal(again["media_inputs"][2]["pixel_values"], media["pixel_values"])
    bus.clear(rows)


def test_a_rows_own_media_comes_back_beside_its_groups_shared_media(bus):
    """A multi-turn trajectory's observed media is a row field (a tuple of dicts, or None) next to
    the group's media: each row gets its own, and the group's stays one object."""
    opening = {"pixel_values": torch.randn(16, 3, 32, 32)}
    shown = ({"pixel_values": torch.randn(64, 3, 32, 32)}, {"pixel_values": torch.randn(2, 3, 8, 8)})
    bus.put_group(11, {"media_inputs": opening}, rows=2)
    rows = bus.put({"response_ids": [[1], [2]], "observed_media": [shown, None]}, group_ids=[11, 11])
    got, values = bus.get("train", ["media_inputs", "observed_media"], 2, timeout=5)
    assert got == rows and values["media_inputs"][0] is values["media_inputs"][1]
    first, second = values["observed_media"]
    assert second is None and isinstance(first, tuple) and len(first) == 2
    assert all(torch.equal(a["pixel_values"], b["pixel_values"]) for a, b in zip(first, shown))
    bus.clear(rows)


def test_the_driver_finds_each_dead_shared_actor_by_name(bus):
    """The bus, the prompt source and the heartbeat board are plain actors Ray does not restart: the
    driver's probe names each one killed (`ray.kill`, standing in for a crash), and only those."""
    from rlx.config import RunConfig
    from rlx.data.rows import PromptRow
    from rlx.data.stream import PromptStream
    from rlx.orchestration.controller import Controller, HeartbeatsClient
    from rlx.orchestration.heartbeats import RemoteHeartbeats
    from rlx.orchestration.prompt_source import PromptSourceClient, RemotePromptSource
    from rlx.orchestration.staleness import StalenessGate

    controller = Controller(RunConfig(train={"mode": "async"}))
    controller.bus = Bus.create(capacity=8)  # its own: the module's bus stays up for the other tests
    stream = PromptStream([PromptRow("q", "a")], seed=0)
    controller.prompts = PromptSourceClient(RemotePromptSource.remote(stream, StalenessGate(0, 1)))
    controller.heartbeats = HeartbeatsClient(RemoteHeartbeats.remote())
    assert controller.lost_shared() == []
    for killed, lost in [("heartbeats", ["heartbeats"]), ("bus", ["bus", "heartbeats"]),
                         ("prompts", ["bus", "prompts", "heartbeats"])]:
        controller.kill_shared(killed)
        assert controller.lost_shared(wait_s=10) == lost


def test_with_the_schema_check_a_put_that_breaks_its_field_fails_at_the_writers_next_flush(bus):
    checked = Bus.create(capacity=8, check_schema=FIELDS)
    tokens = list(range(20_000))  # over INLINE_BYTES: stored in the object store, checked before that
    rows = checked.put({"group_id": [0], "response_ids": [tokens], "rollout_logprobs": [[-1.0] * len(tokens)]},
                       group_ids=[0])
    checked.flush()
    checked.put_fields(rows, {"ref_logprobs": [[-1.0] * (len(tokens) - 1)]})
    with pytest.raises(SchemaError, match=r"'ref_logprobs' \(written by 'reference'\), row 0: expected "
                                          r"float32\[T=20000\], got a list of 19999"):
        checked.flush()
    ray.kill(checked.actor)
