"""Prompt rows -> token ids, through the tokenizer's chat template when there is one."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from rlx.data.rows import DataError, PromptRow, listing

if TYPE_CHECKING:  # transformers costs seconds to import; services without a model skip it
    from transformers import PreTrainedTokenizerBase


def render_prompt(row: PromptRow, tokenizer: PreTrainedTokenizerBase, system_prompt: str | None,
                  apply_chat_template: bool) -> str:
    if apply_chat_template and tokenizer.chat_template:
        messages = row.prompt if isinstance(row.prompt, list) else [{"role": "user", "content": row.prompt}]
        if system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system_prompt}, *messages]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if isinstance(row.prompt, list):
        raise DataError("chat-message prompts need a tokenizer with a chat template (or data.apply_chat_template)")
    return f"{system_prompt}\n{row.prompt}" if system_prompt else row.prompt


def prompt_token_ids(row: PromptRow, tokenizer: PreTrainedTokenizerBase, system_prompt: str | None,
                     apply_chat_template: bool, placeholders: Mapping[str, str] | None = None) -> list[int]:
    """The token ids the rollout sends to the engine for this row, whatever their number.

    `placeholders`: dataset placeholder -> the model's own placeholder token (`<image>` ->
    `<|image_pad|>` for Qwen-VL), substituted before tokenising so each stays one token."""
    text = with_model_placeholders(render_prompt(row, tokenizer, system_prompt, apply_chat_template), placeholders)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def with_model_placeholders(text: str, placeholders: Mapping[str, str] | None) -> str:
    """`text` with each dataset placeholder (`<image>`) as the model's own placeholder token, so
    that it tokenises to one token the processor expands."""
    for tag, token in (placeholders or {}).items():
        text = text.replace(tag, token)
    return text


def encode_prompt(row: PromptRow, tokenizer: PreTrainedTokenizerBase, system_prompt: str | None,
                  apply_chat_template: bool, max_tokens: int, placeholders: Mapping[str, str] | None = None,
                  ) -> list[int]:
    """`prompt_token_ids`, refused past `max_tokens` (`check_prompt_lengths` finds these at load time)."""
    ids = prompt_token_ids(row, tokenizer, system_prompt, apply_chat_template, placeholders)
    if len(ids) > max_tokens:
        where = f"{row.source}: " if row.source else ""
        raise DataError(f"{where}prompt of {len(ids)} tokens exceeds data.max_prompt_tokens={max_tokens}: "
                        "raise data.max_prompt_tokens or shorten the prompt")
    return ids


def check_prompt_lengths(rows: Sequence[PromptRow], encode: Callable[[PromptRow], Sequence[int]],
                         max_tokens: int) -> None:
    """Raise one DataError if any prompt encodes to more than `max_tokens` tokens: how many do, the
    first ones (file:line, or index in `rows`) and the fix. Run at load time, so an over-long prompt
    stops the run before training instead of failing it when the prompt's turn comes."""
    too_long = [(index, row, length) for index, row in enumerate(rows) if (length := len(encode(row))) > max_tokens]
    if not too_long:
        return
    longest = max(length for _, _, length in too_long)
    problems = [f"{row.source or f'row index {index}'}: {length} tokens" for index, row, length in too_long]
    raise DataError(f"{len(too_long)} of {len(rows)} prompt(s) are longer than data.max_prompt_tokens={max_tokens} "
                    f"(the longest has {longest} tokens); the run does not start:{listing(problems)}\n"
                    f"Raise data.max_prompt_tokens to at least {longest}, or shorten or filter out these rows.")
