"""Bucketing of state dicts for weight sync, and the coordinator's release rule."""

import torch

from rlx.weights.buckets import (
    flat_bucket,
    flat_from_buffer,
    flat_size,
    flat_view,
    flatten_parameters,
    pack_flat,
    plan_buckets,
    unpack_flat,
)
from rlx.weights.coordinator import broadcast_ranks, releasable


def _state() -> dict[str, torch.Tensor]:
    embed = torch.randn(10, 4)
    return {"embed.weight": embed, "norm.weight": torch.randn(4).to(torch.bfloat16),
            "layer.weight": torch.randn(4, 4).t(),  # not contiguous
            "step": torch.tensor(3, dtype=torch.int64), "lm_head.weight": embed}


def test_buckets_respect_the_size_bound_and_keep_order():
    state = {f"w{i}": torch.zeros(100) for i in range(10)}  # 400 bytes each
    buckets = plan_buckets(state, bucket_bytes=1000)
    assert [[s.name for s in b] for b in buckets] == [["w0", "w1"], ["w2", "w3"], ["w4", "w5"], ["w6", "w7"],
                                                      ["w8", "w9"]]
    assert [len(b) for b in plan_buckets(state, bucket_bytes=100)] == [1] * 10  # a larger tensor stands alone


def test_tied_tensors_travel_once_and_come_back_under_every_name():
    buckets = plan_buckets(_state(), bucket_bytes=1 << 20)
    names = [s.name for b in buckets for s in b]
    assert "lm_head.weight" not in names
    assert buckets[0][0].aliases == ("lm_head.weight",)


def test_object_store_and_flat_round_trips_are_exact_for_every_dtype():
    state = _state()
    for bucket in plan_buckets(state, bucket_bytes=64):
        stored = flat_from_buffer(pack_flat(state, bucket).numpy().copy())  # what a subscriber gets from Ray
        for rebuilt in (unpack_flat(stored, bucket), unpack_flat(pack_flat(state, bucket), bucket)):
            for spec in bucket:
                for name in (spec.name, *spec.aliases):
                    assert rebuilt[name].dtype == state[name].dtype
                    assert torch.equal(rebuilt[name], state[name]), name
        assert flat_size(bucket) % 64 == 0


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied, as small language models are
        self.register_buffer("step", torch.tensor(3, dtype=torch.int64))


def test_a_flattened_model_publishes_its_buckets_without_a_copy_and_still_trains():
    model = _Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layout = flatten_parameters(model, bucket_bytes=64)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    assert {k: torch.equal(v, before[k]) for k, v in state.items()} == dict.fromkeys(before, True)
    assert model.head.weight is model.embed.weight  # ties survive
    assert plan_buckets(state, 64) == layout
    for bucket in layout:
        view = flat_view(state, bucket)
        assert view is not None and view.numel() == flat_size(bucket)
        assert view.data_ptr() == state[bucket[0].name].data_ptr()  # the parameters' own memory
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.head(model.norm(model.embed(torch.tensor([1, 2])))).sum().backward()
    optimizer.step()
    moved = {k: v.detach() for k, v in model.state_dict().items()}
    rebuilt = {}
    for bucket in layout:
        rebuilt.update(unpack_flat(flat_bucket(moved, bucket).clone(), bucket))
    assert not torch.equal(moved["embed.weight"], before["embed.weight"])
    assert all(torch.equal(rebuilt[k], v) for k, v in moved.items())  # the view tracks the update


def test_an_unflattened_state_dict_is_packed():
    state = _state()
    bucket = plan_buckets(state, 1 << 20)[0]
    assert flat_view(state, bucket) is None
    assert torch.equal(flat_bucket(state, bucket), pack_flat(state, bucket))


def test_flat_bucket_of_the_wrong_size_is_refused():
    bucket = plan_buckets(_state(), 1 << 20)[0]
    try:
        unpack_flat(torch.zeros(8, dtype=torch.uint8), bucket)
    except ValueError as error:
        assert "does not match its layout" in str(error)
    else:
        raise AssertionError("a truncated bucket was accepted")


def test_a_version_is_released_only_when_every_live_subscriber_has_passed_it():
    assert releasable([3, 4, 5], latest=5, acked=[4, 5]) == [3, 4]
    assert releasable([3, 4, 5], latest=5, acked=[3, 5]) == [3]
    assert releasable([3, 4, 5], latest=5, acked=[]) == [3, 4]  # nobody listens: keep only the latest
    assert releasable([5], latest=5, acked=[5]) == []  # the latest always stays for new engines


def test_broadcast_ranks_are_agreed_by_name():
    assert broadcast_ranks(["b", "a", "c"]) == {"a": 1, "b": 2, "c": 3}


def test_a_position_from_another_incarnation_is_older_than_any_publication():
    """Subscribers wait on (incarnation, publication count): a replaced coordinator starts counting
    again, and its first version must still be new to everyone who held a version of the old one."""
    import asyncio

    from rlx.weights.coordinator import WeightCoordinator

    async def scenario():
        old, new = WeightCoordinator(), WeightCoordinator()
        await old.publish(0, [], [])
        await old.publish(1, [], [])
        held = (await old.wait_newer("engine", None, 0))["position"]
        assert held == (old.incarnation, 1)
        assert await old.wait_newer("engine", held, 0) is None  # nothing newer in the same incarnation
        assert await new.wait_newer("engine", held, 0) is None  # a replacement with nothing published yet
        waiter = asyncio.create_task(new.wait_newer("engine", held, 5))
        await new.publish(2, [], [])  # the Actor's next version fills the replacement
        record = await waiter
        assert record["version"] == 2 and record["position"] == (new.incarnation, 0)
        await new.publish(1, [], [], rollback=True)  # a rollback is new too: the count never goes back
        assert (await new.wait_newer("engine", record["position"], 0))["version"] == 1

    asyncio.run(scenario())


def test_flattening_moves_every_alias_and_leaves_a_bucket_across_devices_alone():
    model = _Tiny()
    model.head.weight = torch.nn.Parameter(model.embed.weight.data)  # two Parameters over one storage
    layout = flatten_parameters(model, bucket_bytes=1 << 20)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()  # still one tensor's memory
    assert plan_buckets(state, 1 << 20) == layout and flat_view(state, layout[0]) is not None
    meta = _Tiny()
    meta.norm.to("meta")  # stands in for a second device
    before = meta.embed.weight.data_ptr()
    flatten_parameters(meta, bucket_bytes=1 << 20)
    assert meta.embed.weight.data_ptr() == before  # the bucket spans two devices: not flattened
