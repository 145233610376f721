"""Sparse upcycling: a dense Llama becomes a Mixtral mixture-of-experts that starts out behaving like it.

Recipe (Komatsuzaki et al., "Sparse Upcycling", 2022), used for the built-in `smollm2-moe-4x135m`
(SmolLM2-135M-Instruct -> 4 experts, top-2), a MoE small enough to train on a CPU:

- attention, norms, embeddings and the LM head are copied unchanged;
- every expert is a copy of the layer's dense MLP (gate/up/down), each multiplied element-wise by
  `1 + noise * N(0, 1)`: the experts start as the dense MLP, yet differ, so training can pull them apart;
- the router is drawn small, N(0, router_std): routing starts near-uniform and carries no knowledge;
  the router learns which expert to use during training.

Why the model keeps the dense model's behaviour at the start: Mixtral renormalises its top-k routing
weights to sum to 1, so a token's MLP output is a convex mix of k near-identical copies of the dense
MLP, whichever experts the router picks. With `noise=0` the MoE computes the dense function exactly.
Every random draw comes from one generator seeded by `seed`: the same seed gives the same weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rlx.models.folders import save_model_folder
from rlx.models.loading import load_pretrained

if TYPE_CHECKING:  # transformers costs seconds to import: only the functions that build need it
    from transformers import LlamaForCausalLM, MixtralForCausalLM

DENSE_MODEL = "smollm2-135m-instruct"
EXPERTS = 4
TOP_K = 2
NOISE = 0.01
ROUTER_STD = 0.02


def mixtral_config(dense_config, experts: int, top_k: int):
    """A MixtralConfig with the dense Llama's attention, width, vocabulary, RoPE, norm and tying."""
    from transformers import MixtralConfig

    if dense_config.model_type != "llama":
        raise ValueError(f"model_type={dense_config.model_type!r}: upcycling takes a Llama model")
    if dense_config.attention_bias or dense_config.mlp_bias:
        raise ValueError("attention_bias/mlp_bias=True: Mixtral has no biases, upcycle a Llama without them")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k} with experts={experts}: choose 1 <= top_k <= experts")
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
            "rms_norm_eps", "rope_parameters", "attention_dropout", "tie_word_embeddings",
            "pad_token_id", "bos_token_id", "eos_token_id")
    return MixtralConfig(num_local_experts=experts, num_experts_per_tok=top_k, sliding_window=None,
                         **{key: getattr(dense_config, key) for key in keys})


@torch.no_grad()
def upcycle_llama(dense: LlamaForCausalLM, experts: int = EXPERTS, top_k: int = TOP_K, seed: int = 0,
                  noise: float = NOISE, router_std: float = ROUTER_STD) -> MixtralForCausalLM:
    """The Mixtral upcycled from `dense` (fp32, on the CPU) by the recipe in the module docstring."""
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM(mixtral_config(dense.config, experts, top_k)).float().eval()
    generator = torch.Generator().manual_seed(seed)
    dense_weights = {name: w.detach().float().cpu() for name, w in dense.state_dict().items()}
    for name, weight in model.state_dict().items():
        if name in dense_weights:
            weight.copy_(dense_weights[name])
        elif name.endswith(".mlp.gate.weight"):
            weight.copy_(torch.randn(weight.shape, generator=generator) * router_std)
        elif name.endswith(".mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            mlp = name.removesuffix("experts.gate_up_proj")
            dense_weight = torch.cat([dense_weights[mlp + "gate_proj.weight"], dense_weights[mlp + "up_proj.weight"]])
            weight.copy_(_perturbed_copies(dense_weight, experts, noise, generator))
        elif name.endswith(".mlp.experts.down_proj"):  # [E, H, I]
            mlp = name.removesuffix("experts.down_proj")
            weight.copy_(_perturbed_copies(dense_weights[mlp + "down_proj.weight"], experts, noise, generator))
        else:
            raise ValueError(f"{name}: no weight of the dense model maps to it")
    model.generation_config = dense.generation_config
    return model


def _perturbed_copies(weight: torch.Tensor, copies: int, noise: float, generator: torch.Generator) -> torch.Tensor:
    """`copies` stacked copies of `weight`, each scaled element-wise by 1 + noise * N(0, 1)."""
    scale = 1 + noise * torch.randn((copies, *weight.shape), generator=generator)
    return weight.unsqueeze(0) * scale


def build(target: Path, dense_folder: Path, seed: int = 0) -> Path:
    """Upcycle the built-in SmolLM2 (from the same cache folder) into a safetensors folder at `target`
    (atomically), with the dense model's tokenizer and generation config."""
    dense, tokenizer = load_pretrained(dense_folder)
    model = upcycle_llama(dense, seed=seed)
    return save_model_folder(model, tokenizer, target)
