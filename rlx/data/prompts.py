"""Prompt rows -> token ids, through the tokenizer's chat template when there is one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlx.data.rows import DataError, PromptRow

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


def encode_prompt(row: PromptRow, tokenizer: PreTrainedTokenizerBase, system_prompt: str | None,
                  apply_chat_template: bool, max_tokens: int) -> list[int]:
    text = render_prompt(row, tokenizer, system_prompt, apply_chat_template)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) > max_tokens:
        raise DataError(f"prompt of {len(ids)} tokens exceeds data.max_prompt_tokens={max_tokens}: {text[:80]!r}...")
    return ids
