"""The built-in `hf` generation engine: continuous batching on any transformers causal LM.

Up to `max_batch_size` sequences decode together in one KV cache. A finished row's result is
yielded at once (callers stream it onward). When nothing waits for a slot, finished rows leave the
cache at once and the batch shrinks through the tail. When requests wait, finished rows stay
(ignored) until 1/8 of the batch is free, then leave together and the free slots are refilled with
waiting requests, prefilled on their own and merged into the running cache: removing and merging
rows copies the whole cache, so doing it per finished row would cost more than a few dead rows.

With `record_routes` (mixture-of-experts models) every forward's router choices are kept per row:
a result's `routed_experts` covers its prompt (prefill) and each generated token fed back, in the
layout of `rlx.models.moe`, whatever the batch did around the row (merges, compaction, refills).

A prompt shared by several requests (the n samples of a GRPO group: same tokens, same media object)
is prefilled once and its cache row copied to each of them, which then sample on their own.

M-RoPE models (Qwen-VL) are prefilled with the 3-D positions of `rlx.media.positions`; each row's
next position then carries its own delta (how far its media put its positions behind its token
count), so rows keep their positions as they join and leave the batch.
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlx.engines.attention import use_cpu_attention
from rlx.engines.generation.base import GenerationRequest, GenerationResult, SamplingParams, StreamingEngine
from rlx.engines.generation.kv_cache import GrowingCache
from rlx.media.encode import forward_inputs
from rlx.media.inputs import concat_media, media_token_ids
from rlx.media.positions import POSITION_INPUTS, linear_positions, mrope_positions, uses_mrope
from rlx.models import logits_of_last
from rlx.models.moe import MoeRouting, stack_captured


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k tokens and outside the top-p nucleus.

    Tokens tied with the k-th logit all stay, so top-k may keep a few more than k on exact ties."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p; the first token always stays
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, never: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; return it with its log-prob under the temperature-scaled distribution.

    `never`: tokens that are not sampled (media placeholders), filtered like top-k: their mass stays
    in the log-probs, which the training engine computes over the whole vocabulary too."""
    logits = logits.float()
    allowed = logits.index_fill(-1, torch.tensor(never, device=logits.device), float("-inf")) if never else logits
    if params.temperature == 0:
        tokens = allowed.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    logprobs = torch.log_softmax(logits / params.temperature, -1)
    filtered = bool(never) or params.top_k > 0 or params.top_p < 1.0
    probs = filter_logits(allowed / params.temperature, params.top_k, params.top_p).softmax(-1) if filtered \
        else logprobs.exp()
    tokens = draw(probs, generator)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row by inverse CDF: one uniform draw per row against the running sum.

    Same distribution as `torch.multinomial(probs, 1)`, which draws an exponential per vocabulary
    entry: at batch 32 and SmolLM2's 49k vocabulary that took 14 ms of a 70 ms decode step, this
    takes about 1 ms. The first index whose running sum exceeds the target is never a
    zero-probability token (the sum does not rise there); the target stays below the total even
    when rounding would lift it there."""
    cumulative = probs.cumsum(-1)
    total = cumulative[:, -1:]
    uniform = torch.rand(total.shape, generator=generator, device=probs.device, dtype=total.dtype)
    target = (uniform * total).minimum(total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cumulative, target, right=True).squeeze(-1)


def _left_pad(tensor: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


@dataclass
class _Row:
    request: GenerationRequest
    version: int
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    done: bool = False
    routes: list[torch.Tensor] = field(default_factory=list)  # [n, L, K] chunks, when routes are recorded


@dataclass
class _Running:
    """The decoding batch: one KV cache, and per row its mask, next position and next-token logits."""

    cache: GrowingCache
    attention: torch.Tensor  # [B, L], left-padded, aligned with the cache
    # [B, 1] the position the row's next token takes: its token count, plus its M-RoPE delta (Qwen-VL;
    # the same in all three axes, as for any text token). Per row, so it moves with the row.
    next_position: torch.Tensor
    logits: torch.Tensor  # [B, V] for the token each row samples next
    rows: list[_Row]

    @property
    def alive(self) -> list[int]:
        return [i for i, row in enumerate(self.rows) if not row.done]

    def compact(self) -> None:
        if len(self.alive) < len(self.rows):
            self.select(self.alive)

    def select(self, keep: list[int]) -> None:
        """Keep only these rows, then drop leading columns that are padding for every row left:
        without this, a batch that is refilled forever would carry an ever longer padded cache."""
        index = torch.tensor(keep, dtype=torch.long, device=self.attention.device)
        self.cache.batch_select_indices(index)
        self.attention, self.next_position = self.attention[index], self.next_position[index]
        self.logits, self.rows = self.logits[index], [self.rows[i] for i in keep]
        if not keep:
            return
        start = int(self.attention.any(0).int().argmax())
        if start > 0:
            self.attention = self.attention[:, start:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, start:], layer.values[:, :, start:]

    def merge(self, other: _Running) -> None:
        """Append `other`'s rows; the shorter cache is left-padded (masked) to the longer length."""
        length = max(self.attention.shape[1], other.attention.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, length, 2), _left_pad(theirs.keys, length, 2)])
            mine.values = torch.cat([_left_pad(mine.values, length, 2), _left_pad(theirs.values, length, 2)])
        self.attention = torch.cat([_left_pad(self.attention, length, 1), _left_pad(other.attention, length, 1)])
        self.next_position = torch.cat([self.next_position, other.next_position])
        self.logits = torch.cat([self.logits, other.logits])
        self.rows += other.rows


Refill = Callable[[int], list[GenerationRequest]]


class HFGenerationEngine(StreamingEngine):
    def __init__(
        self,
        model: PreTrainedModel,
        pad_token_id: int,
        eos_token_ids: tuple[int, ...],
        tokenizer: PreTrainedTokenizerBase | None = None,
        max_batch_size: int = 64,
        record_routes: bool = False,
    ) -> None:
        self.model = model.eval()
        use_cpu_attention(model)
        self._routing = MoeRouting.of(model) if record_routes else None
        self._never = media_token_ids(model.config)
        self._mrope = uses_mrope(model)
        self.pad_token_id = pad_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.weight_version = 0
        self._borrowed: set[str] = set()  # weights that are read-only object-store snapshots

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int, shared: bool = False) -> None:
        """Safe between decode steps: rows in flight keep their cache and continue on the new weights.

        `shared` snapshots whose dtype and device match a parameter's become its data as they are
        (no copy; inference never writes them); anything else is copied in. Either way each tensor
        is set directly, which is what keeps a load within a few milliseconds."""
        slots = self._slots
        if state_dict.keys() != slots.keys():
            missing, unexpected = sorted(slots.keys() - state_dict.keys()), sorted(state_dict.keys() - slots.keys())
            raise ValueError(f"weights of version {version} do not match the model: missing={missing[:5]} "
                             f"unexpected={unexpected[:5]}")
        for name, tensor in state_dict.items():  # all checked first: a bad version changes nothing
            if tensor.shape != slots[name].shape:
                raise ValueError(f"weights of version {version}: {name} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(slots[name].shape)}")
        with torch.no_grad():
            for name, tensor in state_dict.items():
                slot = slots[name]
                if shared and tensor.dtype == slot.dtype and tensor.device == slot.device:
                    slot.data = tensor
                    self._borrowed.add(name)
                elif name in self._borrowed:  # never write into a snapshot: other engines read it too
                    slot.data = tensor.to(device=slot.device, dtype=slot.dtype, copy=True)
                    self._borrowed.discard(name)
                else:
                    slot.copy_(tensor)
        self.weight_version = version

    @functools.cached_property
    def _slots(self) -> dict[str, torch.Tensor]:
        """The model's parameters and persistent buffers by state-dict name (tied ones under each).
        Taken once: the engine never moves its model after it is built."""
        return self.model.state_dict(keep_vars=True)

    def stream(
        self,
        requests: list[GenerationRequest],
        params: SamplingParams,
        refill: Refill | None = None,
        between_steps: Callable[[], None] | None = None,
    ) -> Iterator[GenerationResult]:
        """Yield each result as soon as its sequence finishes.

        `refill(free_slots)` may hand over more requests whenever slots are free (async rollout);
        `between_steps()` runs after every decode step (e.g. to load newer weights).
        """
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        pending = deque(requests)
        running: _Running | None = None
        bulk = max(1, self.max_batch_size // 8)
        while True:
            alive = len(running.alive) if running else 0
            free = self.max_batch_size - alive
            if refill is not None and free > len(pending) and (free >= bulk or alive == 0):
                pending.extend(refill(free - len(pending)))
            if pending and (free >= bulk or alive == 0):
                admitted = self._prefill([pending.popleft() for _ in range(min(free, len(pending)))])
                if running is None or alive == 0:
                    running = admitted
                else:
                    running.compact()
                    running.merge(admitted)
            elif running is not None and len(running.rows) - alive >= bulk:
                running.compact()
            if running is None or not running.alive:
                return
            yield from self._decode_step(running, params, generator, shrink=refill is None and not pending)
            if between_steps is not None:
                between_steps()

    def _is_stop(self, token: int, response: list[int], params: SamplingParams) -> bool:
        if token in self.eos_token_ids or token in params.stop_token_ids:
            return True
        if params.stop and self.tokenizer is not None:
            tail = self.tokenizer.decode(response[-16:], skip_special_tokens=True)
            return any(tail.endswith(s) for s in params.stop)
        return False

    def _prefill(self, requests: list[GenerationRequest]) -> _Running:
        """Prefill each distinct prompt once (the n samples of a prompt group share theirs: same
        tokens, same media object), then give every request its prompt's cache row, mask,
        positions, logits and routes."""
        distinct: dict[tuple, int] = {}
        source = [distinct.setdefault((tuple(r.prompt_ids), id(r.media)), len(distinct)) for r in requests]
        if len(distinct) == len(requests):
            return self._prefill_rows(requests)
        running = self._prefill_rows([requests[source.index(i)] for i in range(len(distinct))])
        prefilled = running.rows
        running.select(source)  # each request's row of the cache, mask, positions and logits
        running.rows = [_Row(request, prefilled[i].version, routes=list(prefilled[i].routes))
                        for request, i in zip(requests, source)]
        return running

    @torch.inference_mode()
    def _prefill_rows(self, requests: list[GenerationRequest]) -> _Running:
        width = max(len(r.prompt_ids) for r in requests)
        input_ids = torch.full((len(requests), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(requests), width), dtype=torch.long)
        for row, request in enumerate(requests):  # left padding keeps every row's next token in the last column
            input_ids[row, width - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids)
            attention[row, width - len(request.prompt_ids) :] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        rows_media = [request.media for request in requests]
        next_position = attention.sum(-1, keepdim=True)  # left padding: every row's token count
        if self._mrope:
            grids = concat_media(rows_media, self.device, only=POSITION_INPUTS)
            positions, deltas = mrope_positions(self.model, input_ids, attention, grids)
            next_position = next_position + deltas[:, None]
        else:
            positions = linear_positions(attention)
        cache = GrowingCache()
        with self._recording() as captured, logits_of_last(self.model, 1):
            logits = self.model(
                attention_mask=attention, position_ids=positions, past_key_values=cache, use_cache=True,
                logits_to_keep=1, **forward_inputs(self.model, input_ids, rows_media),
            ).logits[:, -1]
        rows = [_Row(request, self.weight_version) for request in requests]
        if captured:
            routes = stack_captured(captured, len(rows), width)
            for row, request, row_routes in zip(rows, requests, routes):
                row.routes.append(row_routes[width - len(request.prompt_ids):])
        return _Running(cache, attention, next_position, logits, rows)

    @contextlib.contextmanager
    def _recording(self) -> Iterator[list[torch.Tensor]]:
        """Capture the routers' choices of the forward inside, when routes are recorded."""
        if self._routing is None:
            yield []
            return
        with self._routing.capture() as captured:
            yield captured

    @torch.inference_mode()
    def _decode_step(
        self, running: _Running, params: SamplingParams, generator: torch.Generator | None, shrink: bool
    ) -> Iterator[GenerationResult]:
        """Sample one token per live row, retire finished rows, and run the model one step.

        `shrink`: drop finished rows now (nothing waits to take their slots, so the batch only
        shrinks); otherwise they stay, ignored, until slots are refilled in bulk."""
        tokens, token_logprobs = sample_next(running.logits, params, generator, self._never)
        for index, (token, logprob) in enumerate(zip(tokens.tolist(), token_logprobs.tolist())):
            row = running.rows[index]
            if row.done:  # a finished row waiting for the next bulk removal: its token is ignored
                continue
            row.response.append(token)
            row.logprobs.append(logprob)
            if self._is_stop(token, row.response, params):
                row.done = True
                yield self._result(row, "stop")
            elif len(row.response) >= params.max_new_tokens:
                row.done = True
                yield self._result(row, "length")
        if not running.alive:
            return
        if shrink and len(running.alive) < len(running.rows):
            keep = running.alive
            running.select(keep)
            tokens = tokens[torch.tensor(keep, dtype=torch.long, device=tokens.device)]
        running.attention = torch.cat([running.attention, running.attention.new_ones((len(running.rows), 1))], dim=1)
        with self._recording() as captured:
            running.logits = self.model(
                input_ids=tokens[:, None], attention_mask=running.attention, position_ids=running.next_position,
                past_key_values=running.cache, use_cache=True,
            ).logits[:, -1]
        running.next_position = running.next_position + 1
        if captured:
            for row, row_routes in zip(running.rows, stack_captured(captured, len(running.rows), 1)):
                if not row.done:
                    row.routes.append(row_routes)

    def _result(self, row: _Row, reason: str) -> GenerationResult:
        return GenerationResult(
            request_id=row.request.request_id,
            prompt_ids=list(row.request.prompt_ids),
            response_ids=list(row.response),
            logprobs=list(row.logprobs),
            finish_reason=reason,
            weight_version=row.version,
            extra={"last_weight_version": self.weight_version},
            routed_experts=torch.cat(row.routes) if row.routes else None,
        )
