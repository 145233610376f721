"""The GPU path of the Actor and an engine, where CUDA is (skipped elsewhere; marked `cuda`).

The Actor's flattened parameters train on the GPU and still publish as one buffer per bucket; an
`hf` engine on the GPU loads a published version and samples with the log-probs the trainer
computes. The `nccl` broadcast group is built and used, with one rank: a broadcast to a second
rank needs a second GPU (NCCL refuses two ranks on one device).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from rlx.config import TrainConfig
from rlx.engines.generation.base import GenerationRequest, SamplingParams
from rlx.engines.generation.hf import HFGenerationEngine
from rlx.engines.training import TrainingEngine, collate, token_logprobs
from rlx.models import eos_token_ids, load_pretrained
from rlx.weights.buckets import flat_bucket, flat_from_buffer, flat_view, flatten_parameters, unpack_flat

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = ["12+7=", "a much longer prompt to force left padding:", "x", "3-9="]


def _published(state: dict[str, torch.Tensor], layout) -> dict[str, torch.Tensor]:
    """What a subscriber rebuilds from the object store: each bucket's bytes on the host."""
    out: dict[str, torch.Tensor] = {}
    for bucket in layout:
        out.update(unpack_flat(flat_from_buffer(flat_bucket(state, bucket).cpu().numpy()), bucket))
    return out


def _max_logprob_gap(trainer, tokenizer, results) -> float:
    batch = collate([r.prompt_ids for r in results], [r.response_ids for r in results], tokenizer.pad_token_id)
    with torch.no_grad():
        trained, _ = token_logprobs(trainer, batch, 1.0)
    return max((trained[row, : len(r.logprobs)].cpu() - torch.tensor(r.logprobs)).abs().max().item()
               for row, r in enumerate(results))


def test_a_flattened_actor_trains_on_the_gpu_and_an_engine_there_agrees_with_it(tiny_path):
    torch.manual_seed(0)
    model, tokenizer = load_pretrained(tiny_path, "float32", "cuda")
    layout = flatten_parameters(model, bucket_bytes=1 << 16)  # several buckets
    assert len(layout) > 1
    engine = TrainingEngine(model, tokenizer, TrainConfig(lr=1e-2, steps=1, warmup_steps=0), temperature=1.0)
    before = {k: v.clone() for k, v in engine.weights().items()}
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    batch = collate(ids, [[5, 6, 7]] * len(ids), tokenizer.pad_token_id)
    engine.train_step(batch, lambda mb, out, ent: (-(out * mb.response_mask.to(out.device)).sum(), {}))
    state = engine.weights()
    assert not torch.equal(state["lm_head.weight"], before["lm_head.weight"])  # the step moved the weights
    assert all(flat_view(state, bucket) is not None for bucket in layout)  # still one storage per bucket

    generator_model, _ = load_pretrained(tiny_path, "float32", "cuda")
    generator = HFGenerationEngine(generator_model, tokenizer.pad_token_id, eos_token_ids(generator_model, tokenizer),
                                   tokenizer)
    generator.load_weights(_published(state, layout), version=1, shared=True)  # host bytes: copied onto the GPU
    assert all(torch.equal(p, state[n]) for n, p in generator_model.state_dict().items())
    requests = [GenerationRequest(i, prompt) for i, prompt in enumerate(ids * 4)]
    results = generator.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=24, seed=1))
    assert {r.weight_version for r in results} == {1} and any(r.response_ids for r in results)
    gap = _max_logprob_gap(model, tokenizer, results)
    print(f"fp32 on {torch.cuda.get_device_name()}: max |engine - trainer| log-prob = {gap:.2e}")
    assert gap < 1e-4

    bf16_model, _ = load_pretrained(tiny_path, "bfloat16", "cuda")
    bf16 = HFGenerationEngine(bf16_model, tokenizer.pad_token_id, eos_token_ids(bf16_model, tokenizer), tokenizer)
    bf16.load_weights(_published(state, layout), version=1, shared=True)  # fp32 bytes into bf16 weights
    gap = _max_logprob_gap(model, tokenizer, bf16.generate(requests, SamplingParams(temperature=1.0,
                                                                                     max_new_tokens=24, seed=1)))
    print(f"bf16 engine vs fp32 trainer: max |engine - trainer| log-prob = {gap:.2e}")
    assert gap < 0.5  # bf16 rounding of weights and activations, not a wrong load


def test_an_nccl_broadcast_group_forms_and_broadcasts_a_bucket():
    from rlx.weights.broadcast import BroadcastGroup, serve_store

    store = serve_store("127.0.0.1", timeout_s=30)
    group = BroadcastGroup("nccl", store, "127.0.0.1", epoch=1, rank=0, world_size=1, timeout_s=30)
    assert group.device.type == "cuda"
    buffer = torch.arange(1 << 20, dtype=torch.uint8, device=group.device)
    assert torch.equal(group.broadcast(buffer.clone()), buffer)


def test_a_trajectory_waiting_on_a_tool_frees_its_slot_and_resumes_bf16(tiny_path):
    """Multi-turn on a bf16 GPU engine: while one trajectory's tool runs, other trajectories' turns
    decode (its batch slot is free); its next turn resumes from the whole context, and the trainer
    scores every policy token with about the engine's log-prob (bf16 on both sides)."""
    from rlx.agents.environments import user_environment
    from rlx.agents.loop import AgentRollout, TurnLimits
    from rlx.data.rows import PromptRow
    from rlx.roles.batching import samples_to_batch
    from tests.integration.agent_envs import SlowTool

    model, tokenizer = load_pretrained(tiny_path, "bfloat16", "cuda")
    engine = HFGenerationEngine(model, tokenizer.pad_token_id, eos_token_ids(model, tokenizer), tokenizer, 8)
    factory = user_environment("tests.integration.agent_envs:SlowTool", {"rounds": 2, "seconds": 0.5})
    rollout = AgentRollout(engine, tokenizer, factory, TurnLimits(4, 120), concurrency=8)
    stops = tuple(tokenizer.convert_tokens_to_ids(list("aeiou0123456789")))
    params = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=stops, seed=3)
    SlowTool.calls.clear()
    samples = list(rollout.generate([(i, PromptRow(p, ""), []) for i, p in enumerate(PROMPTS)], 2, params))
    assert len(samples) == 8 and any(s.agent_stats["turns"] == 3 for s in samples)
    # a step is called when a policy turn finished decoding: one starting while another tool runs
    # means that turn decoded while the other trajectory waited, out of the batch
    calls = sorted(SlowTool.calls)
    assert any(a_start < b_start < a_end for (a_start, a_end), (b_start, _) in itertools.pairwise(calls))
    with torch.no_grad():
        trained, _ = token_logprobs(model, samples_to_batch(samples, tokenizer.pad_token_id), 1.0)
    for row, sample in enumerate(samples):
        mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
        engine_logprobs = torch.tensor(sample.rollout_logprobs)[mask]
        assert (trained[row, : len(sample.response_ids)].float().cpu()[mask] - engine_logprobs).abs().max() < 5e-2


def test_routes_recorded_by_a_bf16_gpu_engine_replay_in_an_fp32_gpu_trainer(tmp_path):
    """R3 on the GPU: a bf16 engine records routes through continuous batching (sizes match every
    computed position); the fp32 trainer replays exactly those experts in bf16 autocast, and its
    log-probs move toward the engine's."""
    from rlx.models.moe import MoeRouting, stack_captured
    from rlx.models.tiny import build_tiny

    path = build_tiny(tmp_path / "moe", hidden=128, layers=4, moe_family="qwen3_moe")
    engine_model, tokenizer = load_pretrained(path, "bfloat16", "cuda")
    engine = HFGenerationEngine(engine_model, tokenizer.pad_token_id, eos_token_ids(engine_model, tokenizer),
                                tokenizer, 4, record_routes=True)
    requests = [GenerationRequest(i, tokenizer.encode(PROMPTS[i % 4])) for i in range(12)]
    results = [r for r in engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=24, seed=0))
               if r.response_ids]
    assert all(r.routed_experts.shape[0] == len(r.prompt_ids) + len(r.response_ids) - 1 for r in results)
    trainer, _ = load_pretrained(path, "float32", "cuda")
    routing = MoeRouting.of(trainer)
    batch = collate([r.prompt_ids for r in results], [r.response_ids for r in results], tokenizer.pad_token_id,
                    routes=[r.routed_experts for r in results])
    with torch.no_grad(), routing.capture() as captured:
        replayed, _ = token_logprobs(trainer, batch, 1.0, bf16=True)
    used = stack_captured(captured, batch.size, batch.input_ids.shape[1])
    recorded = batch.routes >= 0
    assert torch.equal(used[recorded], batch.routes[recorded])
    with torch.no_grad():
        free, _ = token_logprobs(trainer, collate([r.prompt_ids for r in results], [r.response_ids for r in results],
                                                  tokenizer.pad_token_id), 1.0, bf16=True)
    rollout = torch.zeros_like(replayed.cpu())
    for row, r in enumerate(results):
        rollout[row, : len(r.logprobs)] = torch.tensor(r.logprobs)
    mask = batch.response_mask
    gap = lambda lp: float(((lp.cpu() - rollout).abs() * mask).sum() / mask.sum())
    assert gap(replayed) <= gap(free)


def test_the_sharded_actor_over_nccl_equals_the_one_process_actor(tiny_path, tmp_path):
    """The FSDP2 engine with nccl on as many GPUs as there are, up to 2 (one GPU: a 1-rank group,
    which still runs every collective through nccl), against the one-process Actor on the GPU."""
    import functools

    from rlx.orchestration.builder import build_actor_rank
    from rlx.orchestration.cluster import start_ray, stop_ray
    from rlx.orchestration.rank_group import RankGroup
    from tests.integration.test_colocate_loop import toy_config
    from tests.integration.test_sharded_trainer import TOLERANCE, batch, max_difference, train_one_step

    ranks = min(2, torch.cuda.device_count())
    config = toy_config(tiny_path, tmp_path, train__lr=1e-2, train__micro_batch_size=3, resources__device="cuda",
                        resources__actor={"ranks": ranks, "num_gpus": 1})
    start_ray(num_cpus=8)
    try:
        single = build_actor_rank(config, tiny_path)
        group = RankGroup(functools.partial(build_actor_rank, config, tiny_path), ranks, num_cpus=0.5, num_gpus=1,
                          threads=1)
        try:
            expected = train_one_step(single, batch(), 3)
            got = train_one_step(group, batch(), 3)
            assert got["loss"] == pytest.approx(expected["loss"], abs=1e-4)
            trained = {k: v.cpu() for k, v in single.weights().items()}
            assert max_difference(trained, group.weights()) < 10 * TOLERANCE  # GPU kernels differ in order
        finally:
            group.close()
    finally:
        stop_ray()


def test_media_prefill_and_mrope_positions_in_bf16_on_the_gpu():
    """A tiny Qwen2-VL in bf16 on the GPU: the engine prefills images with 3-D positions and decodes
    at each row's delta; the trainer's log-probs agree within bf16's resolution, and the 3-D
    positions equal those computed on the CPU in fp32 (integers: exactly)."""
    from rlx.media.inputs import concat_media
    from rlx.media.positions import POSITION_INPUTS, position_ids
    from rlx.models.tiny_vl import EOS_ID, PAD_ID, tiny_vl_model
    from tests.integration.media_checks import trainer_logprobs
    from tests.integration.test_qwen_vl_engine import requests_for

    cpu_model, _ = tiny_vl_model("qwen2_vl")
    requests = requests_for(cpu_model)
    model, _ = tiny_vl_model("qwen2_vl")
    model = model.to("cuda", torch.bfloat16)
    engine = HFGenerationEngine(model, PAD_ID, (EOS_ID,), max_batch_size=4)
    results = engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=8, seed=1))
    trained = trainer_logprobs(model, requests, results, PAD_ID)
    gap = max((t.float().cpu() - torch.tensor(r.logprobs)).abs().max().item() for t, r in zip(trained, results))
    assert gap < 5e-2, gap
    batch = collate([r.prompt_ids for r in results], [r.response_ids for r in results], PAD_ID,
                    media=[{r.request_id: r.media for r in requests}[r.request_id] for r in results])
    grids = concat_media(batch.media, only=POSITION_INPUTS)
    on_gpu = position_ids(model, batch.input_ids.cuda(), batch.attention_mask.cuda(),
                          {key: value.cuda() for key, value in grids.items()})
    on_cpu = position_ids(cpu_model, batch.input_ids, batch.attention_mask, grids)
    assert torch.equal(on_gpu.cpu(), on_cpu)
