"""DCS on a real Ray cluster: the driver publishes a tiny model's weights, engine actors subscribe,
and the coordinator is a Serve application.

Killing a subscriber with `ray.kill` stands in for a crashed engine, and the coordinator's own
`inject_fault` kills its process (fault injection)."""

from __future__ import annotations

import time

import pytest
import ray
import torch
from ray import serve

from rlx.models import load_pretrained
from rlx.orchestration.cluster import start_ray, stop_ray
from rlx.weights import WeightSync
from rlx.weights.buckets import flatten_parameters


@ray.remote(num_cpus=0.1)
class Engine:
    """A subscriber the way engines use one: load before serving, apply between steps."""

    def __init__(self, sync: WeightSync, name: str, path: str) -> None:
        self.model = load_pretrained(path)[0]
        self.subscriber = sync.subscriber(name, self.load)
        self.version = -1

    def load(self, state_dict, version: int) -> None:
        self.model.load_state_dict(state_dict)
        self.version = version

    def start(self) -> int:
        return self.subscriber.start()

    def step(self) -> int:
        """One 'decode step' boundary: apply whatever arrived."""
        self.subscriber.apply()
        return self.version

    def checksum(self) -> float:
        return float(sum(p.double().sum() for p in self.model.state_dict().values()))

    def by_broadcast(self) -> int:
        return self.subscriber.received_by_broadcast


def _checksum(state) -> float:
    return float(sum(t.double().sum() for t in state.values()))


def _until(engines, version: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(v == version for v in ray.get([e.step.remote() for e in engines])):
            return
        time.sleep(0.1)
    raise AssertionError(f"engines did not reach version {version}: {ray.get([e.step.remote() for e in engines])}")


@pytest.fixture(scope="module")
def cluster():
    start_ray(num_cpus=6)
    serve.start(proxy_location="Disabled")  # each test's DCS coordinator is a Serve application
    yield
    stop_ray()


@pytest.fixture(autouse=True)
def remove_coordinators(cluster):
    """Each test deploys its own coordinator; it goes with the test."""
    yield
    for app in serve.status().applications:
        if app.startswith("rlx-dcs-"):
            serve.delete(app)


@pytest.fixture()
def model(tiny_path):
    return load_pretrained(tiny_path)[0]


def _perturbed(model, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=generator) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("channel", ["object-store", "gloo"])
def test_subscribers_load_each_version_and_old_versions_are_released(cluster, model, tiny_path, channel):
    sync = WeightSync.create(channel, bucket_mb=0.05, timeout_s=20)  # several buckets for the tiny model
    publisher = sync.publisher()
    publisher.publish(model.state_dict(), 0)
    engines = [Engine.remote(sync, f"engine-{i}", str(tiny_path)) for i in range(2)]
    assert ray.get([e.start.remote() for e in engines]) == [0, 0]
    for version in (1, 2):
        state = _perturbed(model, version)
        timings = publisher.publish(state, version)
        _until(engines, version)
        assert ray.get([e.checksum.remote() for e in engines]) == pytest.approx([_checksum(state)] * 2, rel=1e-9)
        if channel == "gloo":
            assert timings["broadcast_s"] > 0
    status = sync.status()
    assert status["latest"] == 2 and status["held"] == [2] and status["released"] == 2
    assert {s["version"] for s in status["subscribers"].values()} == {2}
    if channel == "gloo":
        assert ray.get([e.by_broadcast.remote() for e in engines]) == [2, 2]
    for engine in engines:
        ray.kill(engine)


@pytest.mark.parametrize("channel", ["gloo"])  # the late engine reads every bucket from the object store
def test_frozen_weights_are_put_once_and_every_version_still_arrives_whole(cluster, model, tiny_path, channel):
    """A trained adapter on a frozen model: the frozen tensors' buckets are the same objects in
    every version (never put or broadcast again), and engines, old and new, hold every tensor."""
    sync = WeightSync.create(channel, bucket_mb=0.05, timeout_s=20)
    publisher = sync.publisher()
    names = list(model.state_dict())
    frozen = frozenset(name for name in names if "layers.0." not in name)  # layer 0 trains, the rest is frozen
    publisher.publish(model.state_dict(), 0, frozen=frozen)
    engines = [Engine.remote(sync, f"engine-{i}", str(tiny_path)) for i in range(2)]
    assert ray.get([e.start.remote() for e in engines]) == [0, 0]
    first = sync.coordinator.wait_newer.remote(None, None, 0).result()
    fixed = publisher.layout(model.state_dict(), frozen)[1]  # buckets holding frozen tensors only
    assert first["unchanged"] == 0 and 0 < fixed < len(first["refs"])
    base = model.state_dict()
    for version in (1, 2):
        state = {n: t if n in frozen else t + version for n, t in base.items()}
        publisher.publish(state, version, frozen=frozen)
        _until(engines, version)
        assert ray.get([e.checksum.remote() for e in engines]) == pytest.approx([_checksum(state)] * 2, rel=1e-9)
    latest = sync.coordinator.wait_newer.remote(None, None, 0).result()
    assert latest["unchanged"] == fixed and latest["refs"][:fixed] == first["refs"][:fixed]
    assert latest["refs"][fixed:] != first["refs"][fixed:]
    if channel == "gloo":
        assert ray.get([e.by_broadcast.remote() for e in engines]) == [2, 2]
    late = Engine.remote(sync, "engine-late", str(tiny_path))  # a new engine gets the frozen part too
    assert ray.get(late.start.remote()) == 2 and ray.get(late.checksum.remote()) == pytest.approx(_checksum(state))
    publisher.publish(base, 0, rollback=True, frozen=frozen)  # a recovered Actor puts everything again
    assert sync.coordinator.wait_newer.remote(None, None, 0).result()["unchanged"] == 0
    for engine in [*engines, late]:
        ray.kill(engine)


def test_a_new_engine_starts_from_the_latest_version_and_follows_a_rollback(cluster, model, tiny_path):
    sync = WeightSync.create("object-store", timeout_s=20)
    publisher = sync.publisher()
    for version in range(3):
        publisher.publish(_perturbed(model, version), version)
    late = Engine.remote(sync, "late", str(tiny_path))
    assert ray.get(late.start.remote()) == 2
    assert ray.get(late.checksum.remote()) == pytest.approx(_checksum(_perturbed(model, 2)), rel=1e-9)
    # An Actor restarted from its step-1 checkpoint rolls everyone back; newer versions are forgotten.
    assert publisher.publish(_perturbed(model, 1), 1)["put_s"] >= 0  # not newer: ignored
    _until([late], 2, timeout=1)
    publisher.publish(_perturbed(model, 11), 1, rollback=True)
    _until([late], 1)
    assert ray.get(late.checksum.remote()) == pytest.approx(_checksum(_perturbed(model, 11)), rel=1e-9)
    assert sync.status()["held"] == [1]
    ray.kill(late)


def test_a_reader_pulls_each_new_version_without_waiting(cluster, model):
    from rlx.weights import WeightReader

    sync = WeightSync.create("object-store", timeout_s=20)
    publisher, reader, loaded = sync.publisher(), WeightReader(sync), []
    assert not reader.pull(lambda state, version: loaded.append(version))  # nothing published yet
    publisher.publish(model.state_dict(), 0)
    assert reader.pull(lambda state, version: loaded.append(version))
    publisher.publish(_perturbed(model, 1), 1)
    assert reader.pull(lambda state, version: loaded.append(version))
    assert not reader.pull(lambda state, version: loaded.append(version))  # nothing new
    assert loaded == [0, 1]


def test_a_replaced_coordinator_gets_the_last_version_back_at_once(cluster, model, tiny_path):
    """The coordinator dies; Serve replaces it in place, empty. The publisher hands it its last
    version at once, so an engine starting meanwhile need not wait for the next training step (which
    may be waiting for that very engine); the subscribed engine registers again and follows the
    next version."""
    sync = WeightSync.create("object-store", timeout_s=60)
    publisher = sync.publisher(refill=True)
    publisher.publish(model.state_dict(), 0)
    engine = Engine.remote(sync, "engine", str(tiny_path))
    assert ray.get(engine.start.remote()) == 0
    before = sync.status()["incarnation"]
    sync.inject_fault("kill")
    time.sleep(1.0)  # the kill lands a moment after the call returns
    late = Engine.remote(sync, "late", str(tiny_path))
    assert ray.get(late.start.remote()) == 0  # from the refilled replacement
    status = sync.status()
    assert status["incarnation"] != before and status["latest"] == 0
    state = _perturbed(model, 1)
    publisher.publish(state, 1)
    _until([engine, late], 1)
    assert ray.get(engine.checksum.remote()) == pytest.approx(_checksum(state), rel=1e-9)
    assert set(sync.status()["subscribers"]) == {"engine", "late"}  # the engine registered again
    publisher.close()
    for actor in (engine, late):
        ray.kill(actor)


def test_an_engine_waits_for_a_first_version_and_says_why_it_gave_up(cluster, tiny_path):
    sync = WeightSync.create("object-store", timeout_s=1)
    engine = Engine.remote(sync, "early", str(tiny_path))
    with pytest.raises(ray.exceptions.RayTaskError) as error:
        ray.get(engine.start.remote())
    assert "no" in str(error.value) and "first weight version" in str(error.value) and "weights.timeout_s" in str(error.value)
    ray.kill(engine)


def test_a_dead_subscriber_holds_no_version_back_and_leaves_the_broadcast_group(cluster, model, tiny_path):
    sync = WeightSync.create("gloo", timeout_s=10)
    publisher = sync.publisher()
    publisher.publish(model.state_dict(), 0)
    alive, doomed = (Engine.remote(sync, name, str(tiny_path)) for name in ("alive", "doomed"))
    ray.get([alive.start.remote(), doomed.start.remote()])
    ray.kill(doomed)
    # Not yet declared dead: the broadcast times out and the live engine loads from the object store.
    publisher.publish(_perturbed(model, 1), 1)
    _until([alive], 1)
    sync.forget("doomed")  # what the HealthManager does for a replica it replaced
    timings = publisher.publish(_perturbed(model, 2), 2)
    _until([alive], 2)
    status = sync.status()
    assert status["held"] == [2] and not status["subscribers"]["doomed"]["alive"]
    assert timings["broadcast_s"] < sync.timeout_s  # the new group has only live members: no timeout
    assert ray.get(alive.by_broadcast.remote()) == 1
    ray.kill(alive)


def _hf_engine(tiny_path):
    from rlx.engines.generation import EngineSpec, build_generation_engine

    return build_generation_engine("hf", EngineSpec(tiny_path))


@pytest.mark.parametrize("channel", ["object-store", "gloo"])
def test_engine_and_actor_agree_on_logprobs_after_a_sync(cluster, model, tiny_path, channel):
    from rlx.engines.generation import SamplingParams
    from tests.integration.test_generation_vs_training import PROMPTS, _max_logprob_gap, _requests

    sync = WeightSync.create(channel, bucket_mb=0.05, timeout_s=20)
    publisher = sync.publisher()
    publisher.publish(model.state_dict(), 0)
    engine, tokenizer = _hf_engine(tiny_path)
    # object-store: the engine keeps the read-only snapshot as its weights (no copy), as Rollouts do
    shared, received = channel == "object-store", {}

    def load(state, version):
        received.update(state)
        engine.load_weights(state, version, shared=shared)

    subscriber = sync.subscriber("hf", load)
    subscriber.start()
    trained = load_pretrained(tiny_path)[0]
    trained.load_state_dict(_perturbed(model, 7))
    flatten_parameters(trained, sync.bucket_bytes)  # as the Actor's model: buckets leave as views, no packing
    publisher.publish(trained.state_dict(), 1)
    assert subscriber.wait_received(20)  # an idle engine sleeps until a version is there
    assert subscriber.apply() and engine.weight_version == 1
    assert set(sync.wait_acked(1, 1, timeout_s=20)) == {"hf"}  # the ack reached the coordinator
    embed = engine.model.get_input_embeddings().weight
    assert (embed.data_ptr() == received["model.embed_tokens.weight"].data_ptr()) == shared  # zero-copy or copied
    results = engine.generate(_requests(tokenizer, PROMPTS * 2), SamplingParams(temperature=0.8, max_new_tokens=16, seed=4))
    gap = _max_logprob_gap(trained, tokenizer, results, 0.8)
    print(f"{channel}: max |engine - actor| log-prob after sync = {gap:.2e}")
    assert gap < 1e-4
    subscriber.close()


def test_a_version_loaded_mid_generation_keeps_requests_in_flight(cluster, model, tiny_path):
    from rlx.engines.generation import SamplingParams
    from tests.integration.test_generation_vs_training import _requests

    sync = WeightSync.create("object-store", timeout_s=20)
    publisher = sync.publisher()
    publisher.publish(model.state_dict(), 0)
    engine, tokenizer = _hf_engine(tiny_path)
    subscriber = sync.subscriber("hf", engine.load_weights)
    subscriber.start()
    steps = 0

    def between_steps() -> None:  # the Actor publishes while the engine decodes; the engine applies it
        nonlocal steps
        steps += 1
        if steps == 3:
            publisher.publish(_perturbed(model, 1), 1)
            deadline = time.monotonic() + 20
            while not subscriber.apply() and time.monotonic() < deadline:
                time.sleep(0.01)

    requests = _requests(tokenizer, ["go"] * 8)
    params = SamplingParams(temperature=1.0, max_new_tokens=30, seed=5)
    results = list(engine.stream(requests, params, between_steps=between_steps))
    assert sorted(r.request_id for r in results) == list(range(8))  # nothing in flight was dropped
    long = [r for r in results if len(r.response_ids) > 3]
    assert long and all(r.weight_version == 0 and r.extra["last_weight_version"] == 1 for r in long)
    subscriber.close()


def test_the_cluster_stays_on_loopback(cluster):
    """Ray, and the broadcast groups bound to its node address, use 127.0.0.1 only."""
    assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}
    assert ray.get(ray.remote(num_cpus=0)(lambda: ray.util.get_node_ip_address()).remote()) == "127.0.0.1"
