"""The built-in `hf` generation engine: batched sampling on any transformers causal LM.

It keeps one KV cache per wave of up to `max_batch_size` prompts, drops finished rows from the
cache as they finish (so a long tail decodes a shrinking batch), and yields each finished sample at
once so callers can stream it onward.
"""

from __future__ import annotations

from typing import Iterator

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from rlx.engines.generation.base import GenerationRequest, GenerationResult, SamplingParams


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
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; return it with its log-prob under the temperature-scaled distribution."""
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / params.temperature
    logprobs = torch.log_softmax(scaled, -1)
    probs = filter_logits(scaled, params.top_k, params.top_p).softmax(-1)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


class HFGenerationEngine:
    def __init__(
        self,
        model: PreTrainedModel,
        pad_token_id: int,
        eos_token_ids: tuple[int, ...],
        tokenizer: PreTrainedTokenizerBase | None = None,
        max_batch_size: int = 64,
    ) -> None:
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.weight_version = 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        with torch.no_grad():
            self.model.load_state_dict(state_dict, strict=True)
        self.weight_version = version

    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[GenerationResult]:
        """All results, in request order."""
        order = {r.request_id: i for i, r in enumerate(requests)}
        return sorted(self.stream(requests, params), key=lambda res: order[res.request_id])

    def stream(self, requests: list[GenerationRequest], params: SamplingParams) -> Iterator[GenerationResult]:
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        for start in range(0, len(requests), self.max_batch_size):
            yield from self._decode_wave(requests[start : start + self.max_batch_size], params, generator)

    def _is_stop(self, token: int, response: list[int], params: SamplingParams) -> bool:
        if token in self.eos_token_ids or token in params.stop_token_ids:
            return True
        if params.stop and self.tokenizer is not None:
            tail = self.tokenizer.decode(response[-16:], skip_special_tokens=True)
            return any(tail.endswith(s) for s in params.stop)
        return False

    @torch.inference_mode()
    def _decode_wave(
        self, wave: list[GenerationRequest], params: SamplingParams, generator: torch.Generator | None
    ) -> Iterator[GenerationResult]:
        width = max(len(r.prompt_ids) for r in wave)
        input_ids = torch.full((len(wave), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(wave), width), dtype=torch.long)
        for row, request in enumerate(wave):  # left padding keeps every row's next token in the last column
            input_ids[row, width - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids)
            attention[row, width - len(request.prompt_ids) :] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self.model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions,
            past_key_values=cache, use_cache=True, logits_to_keep=1,
        ).logits[:, -1]
        next_position = positions[:, -1:] + 1
        active = list(range(len(wave)))
        responses: list[list[int]] = [[] for _ in wave]
        logprobs: list[list[float]] = [[] for _ in wave]

        for _ in range(params.max_new_tokens):
            tokens, token_logprobs = sample_next(logits, params, generator)
            keep = []
            for row, (token, logprob) in enumerate(zip(tokens.tolist(), token_logprobs.tolist())):
                index = active[row]
                responses[index].append(token)
                logprobs[index].append(logprob)
                if self._is_stop(token, responses[index], params):
                    yield self._result(wave[index], responses[index], logprobs[index], "stop")
                else:
                    keep.append(row)
            if not keep or len(responses[active[keep[0]]]) >= params.max_new_tokens:
                break
            if len(keep) < len(active):
                keep_index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(keep_index)
                tokens, attention, next_position = tokens[keep_index], attention[keep_index], next_position[keep_index]
                active = [active[row] for row in keep]
            attention = torch.cat([attention, attention.new_ones((len(active), 1))], dim=1)
            logits = self.model(
                input_ids=tokens[:, None], attention_mask=attention, position_ids=next_position,
                past_key_values=cache, use_cache=True,
            ).logits[:, -1]
            next_position = next_position + 1
        for row in keep:  # the loop always ends by break: these rows ran out of tokens
            index = active[row]
            yield self._result(wave[index], responses[index], logprobs[index], "length")

    def _result(self, request: GenerationRequest, response: list[int], logprobs: list[float], reason: str):
        return GenerationResult(
            request_id=request.request_id,
            prompt_ids=list(request.prompt_ids),
            response_ids=list(response),
            logprobs=list(logprobs),
            finish_reason=reason,
            weight_version=self.weight_version,
        )
