"""The chat template, used token in and token out.

A trajectory's policy tokens are never re-tokenised. Between two policy turns the rollout needs
only the tokens it did not generate: the end of the assistant turn as the template writes it (after
the policy's own end-of-turn token), the observation messages, and the header of the next assistant
turn. They come from rendering the conversation with and without the new messages and taking the
difference as text, then tokenising that difference once.

This is exact when the template is prefix-stable: rendering more messages only appends text. Most
are; some are not (templates that drop earlier reasoning blocks, or that change a separator at an
assistant-to-tool boundary). `check_template` tries a conversation with a tool round trip at start-up
and says where the trajectory's tokens and the template's render of the whole conversation part.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlx.data.prompts import with_model_placeholders
from rlx.data.rows import DataError, Messages

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


class TemplateDrift(ValueError):
    """The chat template rewrote earlier text when more messages were added."""


def tool_prompt(tool_specs: list[dict]) -> str:
    """How tools are described to a model whose chat template has no tool support (Hermes style)."""
    listed = "\n".join(json.dumps(spec.get("function", spec)) for spec in tool_specs)
    return ("You can call these tools:\n<tools>\n" + listed + "\n</tools>\n"
            'To call a tool, write <tool_call>{"name": <tool name>, "arguments": <arguments object>}</tool_call> '
            "and stop; its result comes back in a message from the tool. When you know the answer, "
            "reply without a tool call.")


def template_supports_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    template = tokenizer.chat_template or ""
    return isinstance(template, str) and "tools" in template


class ChatTokens:
    """Renders conversations for one tokenizer and tool set; hands out prompt and observation tokens."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tool_specs: list[dict] | None = None,
                 checked_tokens: Collection[str] = ()) -> None:
        """`checked_tokens`: control tokens an observation may still write as ids, because the caller
        checks them there (the model's media tokens: the rollout refuses a stray one)."""
        if not tokenizer.chat_template:
            raise ValueError("multi-turn rollouts need a tokenizer with a chat template")
        self.tokenizer = tokenizer
        self.tool_specs = list(tool_specs or [])
        self.native_tools = bool(self.tool_specs) and template_supports_tools(tokenizer)
        eos = tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        # the strings a tokenizer turns into control ids (<|im_start|>, <|im_end|>, media tokens)
        specials = {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
        self.checked_tokens = frozenset(specials.intersection(checked_tokens))
        self.control_strings = frozenset(specials - self.checked_tokens)

    def _with_tool_prompt(self, messages: Messages) -> Messages:
        if not self.tool_specs or self.native_tools:
            return messages
        described = tool_prompt(self.tool_specs)
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": messages[0]["content"] + "\n\n" + described}, *messages[1:]]
        return [{"role": "system", "content": described}, *messages]

    def render(self, messages: Messages, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            self._with_tool_prompt(messages), tools=self.tool_specs if self.native_tools else None,
            tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: Messages) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True))

    def prompt_ids_as_text(self, messages: Messages) -> list[int]:
        """`prompt_ids`, each message content that holds a control token's string encoded as text
        (an agent app's messages carry tool and web output; its earlier turns, decoded without
        special tokens, hold none)."""
        rendered = self.render(messages, add_generation_prompt=True)
        if not any(self._holds_control(message.get("content")) for message in messages):
            return self.encode(rendered)
        return self._encode_as_text("", [], 0, messages, rendered, None)

    def turn_text(self, turn_ids: list[int]) -> str:
        """A policy turn as the environment reads it."""
        return self.tokenizer.decode(turn_ids, skip_special_tokens=True)

    def observation_ids(self, before: Messages, turn_ids: list[int], observation: Messages,
                        placeholders: Mapping[str, str] | None = None) -> list[int]:
        """The tokens after a policy turn (`turn_ids`, which followed the conversation `before`) up to
        the header of the next assistant turn, with `observation` in between. `placeholders`: dataset
        placeholder -> the model's placeholder token, for an observation that shows media."""
        turn = {"role": "assistant", "content": self.turn_text(turn_ids)}
        opened = self.render(before, add_generation_prompt=True)
        with_turn = self.render([*before, turn], add_generation_prompt=False)
        after = self.render([*before, turn, *observation], add_generation_prompt=True)
        if not (with_turn.startswith(opened) and after.startswith(with_turn)):
            raise TemplateDrift("the chat template changes earlier text when messages are added")
        written = with_turn[len(opened):]  # the turn as the template writes it
        closing = self._turn_closing(written, turn_ids)
        if not any(self._holds_control(message.get("content")) for message in observation):
            return self.encode(with_model_placeholders(closing + after[len(with_turn):], placeholders))
        return self._encode_as_text(closing, [*before, turn], len(with_turn), observation, after, placeholders)

    def _turn_closing(self, written: str, turn_ids: list[int]) -> str:
        """What the template writes after the policy's last token (e.g. the newline after <|im_end|>)."""
        for generated in (self.tokenizer.decode(turn_ids, skip_special_tokens=False), self.turn_text(turn_ids)):
            if written.startswith(generated):  # the second: a special token the template does not write
                return written[len(generated):]  # (an end-of-turn token) stays in the trajectory, as generated
        if turn_ids and turn_ids[-1] in self.eos_ids:  # the template rewrote the content (whitespace, reasoning)
            end = self.tokenizer.decode(turn_ids[-1:], skip_special_tokens=False)
            if end in written:
                return written[written.rindex(end) + len(end):]
        raise TemplateDrift("the chat template does not write the assistant turn as the policy generated it")

    def _holds_control(self, content: object) -> bool:
        return isinstance(content, str) and any(control in content for control in self.control_strings)

    def _encode_as_text(self, closing: str, conversation: Messages, written: int, observation: Messages, after: str,
                        placeholders: Mapping[str, str] | None) -> list[int]:
        """The observation's tokens with each content that holds a control token's string encoded as
        plain text (a tool result's `<|im_end|>` stays characters, so it cannot close its turn or
        forge another), and the template's own markers as control ids. Each such content is found by
        rendering it as a unique marker; a template that does not write it verbatim is refused.
        `written`: how much of the render is `conversation`'s (the policy's turn included)."""
        nonce = secrets.token_hex(8)
        literal: dict[str, str] = {}
        marked = []
        for index, message in enumerate(observation):
            if self._holds_control(message.get("content")):
                mark = f"\x00rlx-{nonce}-{index}\x00"
                literal[mark] = message["content"]
                message = {**message, "content": mark}
            marked.append(message)
        rendered = self.render([*conversation, *marked], add_generation_prompt=True)
        restored = rendered
        for mark, content in literal.items():
            restored = restored.replace(mark, content)
        if restored != after:
            raise DataError("an observation holds a control token's text (" + ", ".join(sorted(
                c for c in self.control_strings if any(c in content for content in literal.values())))
                + ") and the chat template does not write it verbatim, so it cannot be encoded as plain text: "
                "keep control tokens out of tool and environment output")
        ids: list[int] = []
        pattern = "(" + "|".join(re.escape(mark) for mark in literal) + ")"
        for piece in re.split(pattern, closing + rendered[written:]):
            if piece in literal:
                ids += self._plain(literal[piece], placeholders)
            else:
                ids += self.encode(with_model_placeholders(piece, placeholders))
        return ids

    def _plain(self, content: str, placeholders: Mapping[str, str] | None) -> list[int]:
        """`content` as text, control token strings included; a dataset placeholder (`<image>`) still
        becomes the model's placeholder token, and a checked token its id, as in any observation."""
        kept = {**{token: token for token in self.checked_tokens}, **(placeholders or {})}
        ids: list[int] = []
        pattern = "(" + "|".join(re.escape(text) for text in sorted(kept, key=len, reverse=True)) + ")"
        for part in re.split(pattern, content) if kept else [content]:
            if part in kept:
                ids += self.encode(kept[part])
            elif part:
                ids += self.tokenizer(part, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return ids


@dataclass(frozen=True)
class TemplateCheck:
    exact: bool
    detail: str


def check_template(chat: ChatTokens, tool_name: str = "calculator") -> TemplateCheck:
    """Build a trajectory token in / token out for a conversation with a tool round trip and compare
    it with the template's render of the whole conversation."""
    call = f'<tool_call>{{"name": "{tool_name}", "arguments": {{"expression": "17 + 25"}}}}</tool_call>'
    conversation: Messages = [{"role": "user", "content": "What is 17 + 25?"}]
    observation: Messages = [{"role": "tool", "name": tool_name, "content": "42"}]
    eos = [next(iter(chat.eos_ids))]
    first, final = chat.encode(call) + eos, chat.encode("The answer is 42.") + eos
    try:
        built = (chat.prompt_ids(conversation) + first
                 + chat.observation_ids(conversation, first, observation) + final)
    except TemplateDrift as drift:
        return TemplateCheck(False, str(drift))
    whole = [*conversation, {"role": "assistant", "content": call}, *observation,
             {"role": "assistant", "content": "The answer is 42."}]
    rendered = chat.encode(chat.render(whole, add_generation_prompt=False))
    if rendered[:len(built)] == built:
        return TemplateCheck(True, f"token in / token out equals the template's render ({len(built)} tokens)")
    split = next((i for i, (a, b) in enumerate(zip(built, rendered)) if a != b), min(len(built), len(rendered)))
    return TemplateCheck(False, f"the trajectory and the template's render part at token {split}: "
                                f"{chat.tokenizer.decode(built[split:split + 8])!r} against "
                                f"{chat.tokenizer.decode(rendered[split:split + 8])!r}; rlx trains on the "
                                "trajectory's tokens, which the model generated, so training stays exact, but "
                                "prompts rendered by the template for evaluation or serving will differ")
