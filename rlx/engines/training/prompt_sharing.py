"""Rows that share a prompt (a GRPO group: n samples of one prompt) run that prompt once.

Two ways, same logits up to float rounding (and so the same gradients):
- packed: each distinct prompt followed by all its rows' responses back to back (a block), each
  response attending to the prompt and to itself only (a 4-D mask), its positions starting where
  the prompt ends; blocks packed into few sequences. No prompt is repeated, little is padded.
  Needs an attention that honours a custom mask (`sdpa`, `eager`, rlx's CPU kernel), full
  attention, and blocks of at most `MAX_PACKED_BLOCK` tokens.
- cached: each distinct prompt runs once with a KV cache, indexed per row for the responses
  (right-padded as usual); gradients reach the prompt's activations through the cache. Works with
  any attention, not under activation checkpointing (transformers turns the cache off there).

On the chain_sum shapes of `rlx bench trl` (prompts of ~44 tokens, groups of 8 responses of ~16),
packing trains on about a third of the tokens a padded batch holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlx.engines.training.batch import TokenBatch
from rlx.media.positions import linear_positions, uses_mrope
from rlx.models.moe import routing_of

if TYPE_CHECKING:  # transformers costs seconds to import
    from transformers import PreTrainedModel

MASKED_ATTENTION = frozenset({"sdpa", "eager", "rlx_grouped_sdpa"})  # take a custom 4-D mask as given
# Packed sequences hold blocks up to this many tokens: fewer, longer sequences waste no padding but
# attend over more masked-out columns (attention costs grow with the square of the length).
PACKED_TOKENS = 512
# A block (a prompt and its responses) longer than this takes the cached way: its mask and attention
# would grow with the square of its length.
MAX_PACKED_BLOCK = 4096


def prompt_groups(model: PreTrainedModel, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`(first row of each distinct prompt, each row's prompt index)` when rows share prompts and a
    prompt-once forward applies: 1-D positions, no media, and no routing replay installed (R3
    replays, and its load-balancing loss reads, every column as the padded batch lays it out)."""
    if batch.routes is not None or routing_of(model) is not None or any(batch.media or []) or uses_mrope(model):
        return None
    width = batch.input_ids.shape[1] - batch.response_width
    prompts = torch.cat([batch.input_ids[:, :width], batch.attention_mask[:, :width]], dim=1)
    distinct, row_prompt = torch.unique(prompts, dim=0, return_inverse=True)
    if len(distinct) == batch.size:
        return None
    rows = torch.arange(batch.size)
    first_rows = torch.full((len(distinct),), batch.size).scatter_reduce(0, row_prompt, rows, "amin")
    if not (_packed(model, batch, first_rows, row_prompt) or _caches(model)):
        return None  # neither way applies: the padded forward
    return first_rows, row_prompt


def packs(model: PreTrainedModel) -> bool:
    """True when the model's attention takes a custom 4-D mask and no layer attends in a sliding window."""
    config = model.config
    windowed = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    return config._attn_implementation in MASKED_ATTENTION and not windowed and layer_types == {"full_attention"}


def _caches(model: PreTrainedModel) -> bool:
    return not (model.training and getattr(model, "is_gradient_checkpointing", False))


def shared_prompt_logits(model: PreTrainedModel, batch: TokenBatch,
                         groups: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """[B, R, V] logits predicting the response tokens (as `token_logprobs` lays them out), each
    distinct prompt run once. Runs under the caller's autocast."""
    return (packed_logits if _packed(model, batch, *groups) else cached_logits)(model, batch, *groups)


def _packed(model: PreTrainedModel, batch: TokenBatch, first_rows: torch.Tensor, row_prompt: torch.Tensor) -> bool:
    """Whether these groups take the packed way (else the cached one)."""
    return packs(model) and _longest_block(batch, first_rows, row_prompt) <= MAX_PACKED_BLOCK


def _longest_block(batch: TokenBatch, first_rows: torch.Tensor, row_prompt: torch.Tensor) -> int:
    width = batch.input_ids.shape[1] - batch.response_width
    responses = torch.zeros(len(first_rows), dtype=torch.long).scatter_add_(
        0, row_prompt, batch.attention_mask[:, width:].sum(1).long())
    return int((batch.attention_mask[first_rows, :width].sum(1) + responses).max())


def packed_logits(model: PreTrainedModel, batch: TokenBatch, first_rows: torch.Tensor,
                  row_prompt: torch.Tensor) -> torch.Tensor:
    """Each distinct prompt once, followed by its rows' responses: a block. Blocks are packed into
    as few sequences as fit `PACKED_TOKENS` (a longer block gets a sequence of its own)."""
    device = next(model.parameters()).device
    width = batch.input_ids.shape[1] - batch.response_width
    prompt_lengths = batch.attention_mask[:, :width].sum(1).tolist()
    response_lengths = batch.attention_mask[:, width:].sum(1).tolist()
    rows_of: list[list[int]] = [[] for _ in first_rows]
    for row, prompt in enumerate(row_prompt.tolist()):
        rows_of[prompt].append(row)
    firsts = first_rows.tolist()
    sizes = [prompt_lengths[first] + sum(response_lengths[r] for r in rows) for first, rows in zip(firsts, rows_of)]
    sequences = _first_fit(sizes, max(max(sizes), PACKED_TOKENS))
    packed_width = max(sum(sizes[b] for b in blocks) for blocks in sequences)
    ids = torch.zeros((len(sequences), packed_width), dtype=batch.input_ids.dtype)
    positions = torch.zeros_like(ids)
    block_of = torch.full_like(ids, -1)  # the block a column belongs to (padding: -1)
    owner = torch.full_like(ids, -2)  # -1: the block's prompt, r >= 0: row r's response, -2: padding
    sequence_of_row = torch.zeros(batch.size, dtype=torch.long)
    predictor = torch.full((batch.size, batch.response_width), -1, dtype=torch.long)  # column predicting each token
    for sequence, blocks in enumerate(sequences):
        start = 0
        for block in blocks:
            first, length = firsts[block], prompt_lengths[firsts[block]]
            columns = slice(start, start + length)
            ids[sequence, columns] = batch.input_ids[first, width - length : width]
            positions[sequence, columns] = torch.arange(length)
            block_of[sequence, columns], owner[sequence, columns] = block, -1
            prompt_end, start = start + length, start + length
            for row in rows_of[block]:
                size = response_lengths[row]
                columns = slice(start, start + size)
                ids[sequence, columns] = batch.input_ids[row, width : width + size]
                positions[sequence, columns] = torch.arange(length, length + size)
                block_of[sequence, columns], owner[sequence, columns] = block, row
                predictor[row, 0] = prompt_end - 1
                predictor[row, 1:size] = torch.arange(start, start + size - 1)
                sequence_of_row[row] = sequence
                start += size
    keep_from = int(predictor[predictor >= 0].min())  # no earlier column predicts a response token
    predictor = (predictor - keep_from).clamp(min=0)  # padding tokens read any kept column
    logits = model(input_ids=ids.to(device), attention_mask=_packed_mask(block_of, owner, model).to(device),
                   position_ids=positions.to(device), use_cache=False,
                   logits_to_keep=packed_width - keep_from).logits
    return logits[sequence_of_row.to(device).unsqueeze(1), predictor.to(device)]


def _first_fit(sizes: list[int], capacity: int) -> list[list[int]]:
    """Indices of `sizes` grouped into bins of at most `capacity`, largest first (first-fit decreasing)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        fits = next((b for b, left in enumerate(room) if left >= sizes[index]), None)
        if fits is None:
            bins.append([index])
            room.append(capacity - sizes[index])
        else:
            bins[fits].append(index)
            room[fits] -= sizes[index]
    return bins


def _packed_mask(block_of: torch.Tensor, owner: torch.Tensor, model: PreTrainedModel) -> torch.Tensor:
    """[S, 1, L, L]: within its block, a token sees earlier tokens of its own part, and a response
    the whole prompt. Padding sees padding, so no row of the softmax is empty. Boolean for SDPA,
    additive for eager."""
    width = block_of.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    same_block = block_of.unsqueeze(2) == block_of.unsqueeze(1)
    same_part = owner.unsqueeze(2) == owner.unsqueeze(1)
    sees_prompt = (owner.unsqueeze(2) >= 0) & (owner.unsqueeze(1) == -1)
    allowed = (causal & same_block & (same_part | sees_prompt)).unsqueeze(1)
    if model.config._attn_implementation != "eager":
        return allowed
    dtype = next(model.parameters()).dtype
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def cached_logits(model: PreTrainedModel, batch: TokenBatch, first_rows: torch.Tensor,
                  row_prompt: torch.Tensor) -> torch.Tensor:
    """Each distinct prompt once with a KV cache: its last column predicts every sharing row's first
    token, the cache (indexed per row) serves the rest of the (right-padded) responses."""
    device = next(model.parameters()).device
    input_ids, attention_mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    positions = linear_positions(attention_mask)
    first_rows, row_prompt = first_rows.to(device), row_prompt.to(device)
    width, responses = input_ids.shape[1] - batch.response_width, batch.response_width
    prompt = model(input_ids=input_ids[first_rows, :width], attention_mask=attention_mask[first_rows, :width],
                   position_ids=positions[first_rows, :width], use_cache=True, logits_to_keep=1)
    first = prompt.logits[row_prompt]
    if responses == 1:
        return first
    cache = prompt.past_key_values
    cache.batch_select_indices(row_prompt)
    end = width + responses - 1  # the last response token predicts nothing
    rest = model(input_ids=input_ids[:, width:end], attention_mask=attention_mask[:, :end],
                 position_ids=positions[:, width:end], past_key_values=cache, use_cache=True).logits
    return torch.cat([first, rest], dim=1)
