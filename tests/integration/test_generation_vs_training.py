"""The generation engine and the training engine agree on log-probs, and the engine streams."""

from __future__ import annotations

import torch

from rlx.engines.generation.base import GenerationRequest, SamplingParams
from rlx.engines.generation.hf import HFGenerationEngine
from rlx.engines.training import collate, token_logprobs
from rlx.models import eos_token_ids


def _engine(model, tokenizer, batch=64):
    return HFGenerationEngine(model, tokenizer.pad_token_id, eos_token_ids(model, tokenizer), tokenizer, batch)


def _requests(tokenizer, prompts):
    return [GenerationRequest(i, tokenizer(p, add_special_tokens=False)["input_ids"]) for i, p in enumerate(prompts)]


PROMPTS = ["12+7=", "a much longer prompt to force left padding:", "x", "3-9="]


def _max_logprob_gap(model, tokenizer, results, temperature):
    batch = collate([r.prompt_ids for r in results], [r.response_ids for r in results], tokenizer.pad_token_id)
    with torch.no_grad():
        trained, _ = token_logprobs(model, batch, temperature)
    gaps = [
        (trained[row, : len(r.logprobs)] - torch.tensor(r.logprobs)).abs().max().item()
        for row, r in enumerate(results)
    ]
    return max(gaps)


def test_logprobs_agree_fp32(tiny):
    model, tokenizer = tiny
    engine = _engine(model, tokenizer)
    params = SamplingParams(temperature=0.7, max_new_tokens=24, seed=1)
    results = engine.generate(_requests(tokenizer, PROMPTS * 4), params)
    assert {len(r.response_ids) for r in results} != {0}
    assert _max_logprob_gap(model, tokenizer, results, 0.7) < 1e-4


def test_logprobs_agree_after_weight_load(tiny, tiny_path):
    from rlx.models import load_pretrained

    model, tokenizer = tiny
    trainer_model, _ = load_pretrained(tiny_path)
    with torch.no_grad():
        for p in trainer_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine = _engine(model, tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=2)
    before = engine.generate(_requests(tokenizer, PROMPTS), params)
    engine.load_weights(trainer_model.state_dict(), version=3)
    after = engine.generate(_requests(tokenizer, PROMPTS), params)
    assert engine.weight_version == 3 and all(r.weight_version == 3 for r in after)
    assert [r.response_ids for r in before] != [r.response_ids for r in after]
    assert _max_logprob_gap(trainer_model, tokenizer, after, 1.0) < 1e-4


def test_stream_yields_each_sample_as_it_finishes(tiny):
    model, tokenizer = tiny
    engine = _engine(model, tokenizer)
    frequent = tokenizer.convert_tokens_to_ids(list("aeiou0123456789 "))
    params = SamplingParams(temperature=1.0, max_new_tokens=40, stop_token_ids=tuple(frequent), seed=3)
    lengths = [len(r.response_ids) for r in engine.stream(_requests(tokenizer, ["go"] * 16), params)]
    assert len(lengths) == 16
    assert lengths == sorted(lengths), "results must arrive in finishing order"
    assert lengths[0] < lengths[-1]


def test_finished_rows_leave_the_batch_without_changing_results(tiny):
    """Pruning finished rows from the KV cache must not change the other rows' tokens."""
    model, tokenizer = tiny
    requests = _requests(tokenizer, ["go", "stop early please", "a", "bb", "Q: 12+30=", "zz top"])
    free = _engine(model, tokenizer).generate(requests, SamplingParams(0.0, max_new_tokens=20))
    stop = (free[0].response_ids[2],)  # row 0 stops by its third token; the others at their own pace
    params = SamplingParams(0.0, max_new_tokens=20, stop_token_ids=stop)
    together = _engine(model, tokenizer).generate(requests, params)
    alone = [_engine(model, tokenizer).generate([r], params)[0] for r in requests]
    assert [r.response_ids for r in together] == [r.response_ids for r in alone]
    assert len({len(r.response_ids) for r in together}) > 1


def test_seeded_sampling_is_reproducible_and_honours_max_tokens(tiny):
    model, tokenizer = tiny
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_new_tokens=7, seed=11)
    first = _engine(model, tokenizer).generate(_requests(tokenizer, PROMPTS), params)
    second = _engine(model, tokenizer).generate(_requests(tokenizer, PROMPTS), params)
    assert [r.response_ids for r in first] == [r.response_ids for r in second]
    assert all(len(r.response_ids) <= 7 for r in first)
    assert all(r.finish_reason in ("stop", "length") for r in first)


def test_continuous_batching_refills_slots_without_changing_results(tiny):
    """Rows that join a running batch (merged, left-padded caches) decode exactly as if alone."""
    model, tokenizer = tiny
    prompts = ["go", "a much longer prompt here", "x", "Q: 12+30=", "zz top", "b", "hello world!"]
    requests = _requests(tokenizer, prompts)
    free = _engine(model, tokenizer).generate(requests, SamplingParams(0.0, max_new_tokens=12))
    stop = (free[0].response_ids[1], free[3].response_ids[4])
    params = SamplingParams(0.0, max_new_tokens=12, stop_token_ids=stop)
    alone = [_engine(model, tokenizer).generate([r], params)[0] for r in requests]

    engine = _engine(model, tokenizer, batch=3)
    waiting = list(requests[2:])
    asked = []

    def refill(slots):
        asked.append(slots)
        taken, waiting[:] = waiting[:slots], waiting[slots:]
        return taken

    streamed = {r.request_id: r for r in engine.stream(requests[:2], params, refill=refill)}
    assert sorted(streamed) == list(range(len(prompts)))
    assert [streamed[i].response_ids for i in range(len(prompts))] == [r.response_ids for r in alone]
    assert len(asked) > 1, "free slots must be refilled while the batch is running"
    assert _max_logprob_gap(model, tokenizer, [streamed[i] for i in range(len(prompts))], 1.0) < 1e-4


def test_a_shared_snapshot_becomes_the_weights_and_is_never_written(tiny, tiny_path):
    """DCS hands engines read-only object-store snapshots (`shared=True`): they become the
    parameters without a copy, and a later copying load replaces them instead of writing into
    memory other engines read."""
    from rlx.models import load_pretrained

    model, tokenizer = tiny
    engine = _engine(model, tokenizer)
    snapshot = {k: v.detach().clone() for k, v in load_pretrained(tiny_path)[0].state_dict().items()}
    kept = {k: v.clone() for k, v in snapshot.items()}
    engine.load_weights(snapshot, version=1, shared=True)
    weight = model.model.embed_tokens.weight
    assert weight.data_ptr() == snapshot["model.embed_tokens.weight"].data_ptr()  # no copy
    update = {k: v + 1.0 for k, v in kept.items()}
    engine.load_weights(update, version=2)
    assert all(torch.equal(snapshot[k], kept[k]) for k in kept)  # the snapshot is untouched
    assert torch.equal(model.model.embed_tokens.weight, update["model.embed_tokens.weight"])
    engine.load_weights(kept, version=3)  # a copying load after that writes the engine's own memory
    assert torch.equal(model.model.embed_tokens.weight, kept["model.embed_tokens.weight"])
    try:
        engine.load_weights({"nonsense": torch.zeros(1)}, version=4)
    except ValueError as error:
        assert "missing=" in str(error) and "nonsense" in str(error)
    else:
        raise AssertionError("weights with the wrong names were accepted")
    assert engine.weight_version == 3


def test_a_prompt_shared_by_a_group_is_prefilled_once(tiny):
    """The n samples of a prompt share its prefill: one cache row per distinct prompt, copied to
    each sample, which then samples on its own; the log-probs still equal the trainer's."""
    model, tokenizer = tiny
    batches = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: batches.append(
        (kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]).shape[:2]),
        with_kwargs=True)
    try:
        group = [GenerationRequest(i, r.prompt_ids) for i, r in enumerate(_requests(tokenizer, PROMPTS * 4))]
        results = _engine(model, tokenizer).generate(group, SamplingParams(temperature=1.0, max_new_tokens=12, seed=4))
    finally:
        hook.remove()
    assert batches[0][0] == len(PROMPTS) and all(b == (16, 1) for b in batches[1:3])  # 4 prefilled, 16 decode
    assert len({tuple(r.response_ids) for r in results}) > len(PROMPTS)  # each sample drew its own tokens
    assert _max_logprob_gap(model, tokenizer, results, 1.0) < 1e-4
