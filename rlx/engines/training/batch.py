"""Token batches laid out so every response starts in the same column.

Prompts are left-padded to width P and responses right-padded to width R. The logits that predict
the response tokens are then the columns P-1 .. P+R-2 for every row, so the model only projects the
last R+1 hidden states onto the vocabulary (`logits_to_keep`), never the prompt's.

A mixture-of-experts batch may carry `routes` `[B, P+R, L, K]`: the experts the rollout engine
chose for each input column (`rlx.models.moe`), which the forward passes replay (R3), and
`media`: each row's prompt media inputs, which the forward passes hand to the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlx.media.inputs import RowMedia
from rlx.media.positions import linear_positions
from rlx.models.moe import NOT_RECORDED, ROUTE_DTYPE


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [B, P+R]
    attention_mask: torch.Tensor  # [B, P+R]
    response_ids: torch.Tensor  # [B, R]
    response_mask: torch.Tensor  # [B, R] float: 1 where the token is trained on
    per_token: dict[str, torch.Tensor] = field(default_factory=dict)  # [B, R] fields (advantages, old logprobs...)
    per_sequence: dict[str, torch.Tensor] = field(default_factory=dict)  # [B] fields
    routes: torch.Tensor | None = None  # [B, P+R, L, K] recorded experts per input column (MoE, R3)
    media: list[RowMedia | None] | None = None  # per row: its media inputs, one object or parts (rlx.media.inputs)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_width(self) -> int:
        return self.response_ids.shape[1]

    @property
    def position_ids(self) -> torch.Tensor:
        """1-D positions (M-RoPE models get theirs from the model: rlx.media.positions)."""
        return linear_positions(self.attention_mask)

    def select(self, rows: torch.Tensor | slice) -> TokenBatch:
        """A sub-batch, trimmed of columns that are padding in every selected row."""
        attention = self.attention_mask[rows]
        prompt_width = self.input_ids.shape[1] - self.response_width
        attended = attention.sum(0).nonzero().squeeze(-1)
        first, last = int(attended.min()), max(int(attended.max()), prompt_width)  # keep >= 1 response column
        used_response = last - prompt_width + 1
        cols = slice(first, last + 1)
        return TokenBatch(
            input_ids=self.input_ids[rows][:, cols],
            attention_mask=attention[:, cols],
            response_ids=self.response_ids[rows][:, :used_response],
            response_mask=self.response_mask[rows][:, :used_response],
            per_token={k: v[rows][:, :used_response] for k, v in self.per_token.items()},
            per_sequence={k: v[rows] for k, v in self.per_sequence.items()},
            routes=None if self.routes is None else self.routes[rows][:, cols],
            media=None if self.media is None else _select_rows(self.media, rows),
        )

    def micro_batches(self, size: int) -> list[TokenBatch]:
        return [self.select(slice(i, i + size)) for i in range(0, self.size, size)]


def collate(
    prompts: list[list[int]],
    responses: list[list[int]],
    pad_token_id: int,
    loss_masks: list[list[float]] | None = None,
    per_token: dict[str, list[list[float]]] | None = None,
    per_sequence: dict[str, list[float]] | None = None,
    routes: list[torch.Tensor] | None = None,
    media: list[RowMedia | None] | None = None,
) -> TokenBatch:
    """`routes`: each sequence's recorded experts `[n, L, K]` from its first token on (n may fall
    short of the sequence: the rest is routed by the model itself). `media`: each prompt's media
    inputs (rows of one group share one object: nothing is copied)."""
    batch, prompt_width = len(prompts), max(len(p) for p in prompts)
    width = max(1, max(len(r) for r in responses))
    input_ids = torch.full((batch, prompt_width + width), pad_token_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    response_mask = torch.zeros((batch, width), dtype=torch.float32)
    for row, (prompt, response) in enumerate(zip(prompts, responses)):
        input_ids[row, prompt_width - len(prompt) : prompt_width] = torch.tensor(prompt, dtype=torch.long)
        input_ids[row, prompt_width : prompt_width + len(response)] = torch.tensor(response, dtype=torch.long)
        attention[row, prompt_width - len(prompt) : prompt_width + len(response)] = 1
        mask = loss_masks[row] if loss_masks is not None else [1.0] * len(response)
        response_mask[row, : len(response)] = torch.tensor(mask, dtype=torch.float32)

    def pad_rows(rows: list[list[float]]) -> torch.Tensor:
        out = torch.zeros((batch, width), dtype=torch.float32)
        for row, values in enumerate(rows):
            out[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
        return out

    return TokenBatch(
        routes=None if routes is None else _collate_routes(routes, prompts, input_ids.shape[1]),
        input_ids=input_ids,
        attention_mask=attention,
        response_ids=input_ids[:, prompt_width:].clone(),
        response_mask=response_mask,
        per_token={k: pad_rows(v) for k, v in (per_token or {}).items()},
        per_sequence={k: torch.tensor(v, dtype=torch.float32) for k, v in (per_sequence or {}).items()},
        media=list(media) if media is not None and any(media) else None,
    )


def _select_rows(items: list, rows: torch.Tensor | slice) -> list:
    if isinstance(rows, slice):
        return items[rows]
    index = rows.nonzero().squeeze(-1) if rows.dtype == torch.bool else rows
    return [items[i] for i in index.tolist()]


def _collate_routes(routes: list[torch.Tensor], prompts: list[list[int]], width: int) -> torch.Tensor:
    """Routes placed under their tokens' columns (prompts are left-padded); `NOT_RECORDED` elsewhere."""
    layers, top_k = routes[0].shape[1:]
    out = torch.full((len(routes), width, layers, top_k), NOT_RECORDED, dtype=ROUTE_DTYPE)
    prompt_width = max(len(p) for p in prompts)
    for row, (recorded, prompt) in enumerate(zip(routes, prompts)):
        start = prompt_width - len(prompt)
        count = min(recorded.shape[0], width - start)
        out[row, start : start + count] = recorded[:count]
    return out


_MASK64 = (1 << 64) - 1


def _mix(key: int, seed: int) -> int:
    """A splitmix64-style mix of (seed, key): spread well and the same on every platform and run
    (Python's own hash() is salted per process for strings and leaves small ints as they are)."""
    z = (key + (seed + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def mini_batch_rows(keys: list[int], count: int, seed: int) -> list[list[int]]:
    """Split rows into `count` mini-batches (ascending row indices each) by a seeded hash of each
    row's key, a sample uid: rows are ranked by the hash and dealt out in turn, so sizes differ by
    at most one and a row's mini-batch depends on the step's set of keys, not on their arrival or
    length order. With fewer rows than `count`, the last mini-batches are empty."""
    if count < 1:
        raise ValueError(f"train.mini_batches={count}: a step needs at least one mini-batch; set it to 1 or more")
    ranked = sorted(range(len(keys)), key=lambda row: (_mix(keys[row], seed), keys[row]))
    return [sorted(ranked[start::count]) for start in range(count)]
