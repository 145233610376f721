"""SFT conversations: JSONL rows -> token ids with a loss mask that is 1 only on what the assistant writes.

The mask comes from the model's own chat template, message by message: an assistant message's
tokens are those between the render of the conversation before it (with the generation prompt,
i.e. the assistant header) and the render that includes it. That is exact only if the template is
prefix-stable (adding messages only appends tokens), so each prefix is checked against the render
of the whole conversation, and a template that rewrites earlier text is an error naming the row.

Inside an assistant span, tokens after its last end-of-turn token (e.g. the newline after ChatML's
`<|im_end|>`) are the template's, not the model's: generation stops at the end-of-turn token, so
they stay masked, as they are in multi-turn rollouts.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlx.agents.chat import ChatTokens
from rlx.data.files import _jsonl_records
from rlx.data.rows import listing, quote
from rlx.errors import ConfigError, DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant", "tool")
FORMAT_HINT = ('each line must be {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...], '
               '"tools"?: [...]}')


@dataclass(frozen=True)
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    source: str = ""  # file:line, for error messages


@dataclass(frozen=True)
class MaskedTokens:
    """One conversation as the trainer sees it: `mask[i]` is 1 where `ids[i]` is trained on."""

    ids: list[int]
    mask: list[int]
    source: str = ""
    truncated: bool = False  # cut at max_length

    @property
    def trained_tokens(self) -> int:
        return sum(self.mask)


# -- validation ----------------------------------------------------------------------------------
def _tool_call(call: Any, where: str) -> dict[str, Any]:
    """A tool call in OpenAI form, {"type": "function", "function": {"name", "arguments": object}};
    the flat {"name", "arguments"} form and arguments as a JSON string are accepted too."""
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise DataError(f"{where}: a tool call must be {{\"function\": {{\"name\": str, \"arguments\": {{...}}}}}} "
                        f"or {{\"name\": str, \"arguments\": {{...}}}}, got {quote(call)}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: tool call {function['name']!r} has arguments that are not JSON "
                            f"({exc.msg}); write them as an object") from None
    if not isinstance(arguments, dict):
        raise DataError(f"{where}: tool call {function['name']!r} needs an arguments object, got {quote(arguments)}")
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _message(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise DataError(f"{where}: a message must be an object with 'role' and 'content', got {quote(raw)}")
    role = raw.get("role")
    if role not in ROLES:
        raise DataError(f"{where}: role must be one of {', '.join(ROLES)}, got {quote(role)}")
    message = dict(raw)
    calls = message.pop("tool_calls", None)
    if calls is not None:
        if role != "assistant":
            raise DataError(f"{where}: only assistant messages make tool calls; move 'tool_calls' to the "
                            "assistant message before the tool's reply")
        if not isinstance(calls, list):
            raise DataError(f"{where}: 'tool_calls' must be a list of calls, got {quote(calls)}")
        if calls:
            message["tool_calls"] = [_tool_call(call, where) for call in calls]
    content = message.get("content")
    if content is None and "tool_calls" in message:
        message["content"] = ""  # an OpenAI-style call-only turn
    elif not isinstance(content, str):
        raise DataError(f"{where}: 'content' must be text, got {quote(content)}")
    return message


def validate_conversation(raw: Any, where: str) -> Conversation:
    """One parsed JSONL record -> a Conversation, or a DataError naming `where` (file:line) and the fix."""
    if not isinstance(raw, dict) or "messages" not in raw:
        raise DataError(f"{where}: no 'messages' field; {FORMAT_HINT}")
    messages = raw["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of messages, got {quote(messages)}")
    checked = [_message(m, f"{where}: messages[{i}]") for i, m in enumerate(messages)]
    if not any(m["role"] == "assistant" for m in checked):
        raise DataError(f"{where}: no assistant message, so nothing to learn; add the assistant's reply")
    tools = raw.get("tools") or []
    if not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataError(f"{where}: 'tools' must be a list of tool specs (objects), got {quote(tools)}")
    return Conversation(checked, tools, where)


def load_conversations(path: str | Path) -> list[Conversation]:
    """Every conversation of a JSONL file, or one DataError listing each bad line (file:line)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"sft data file {str(path)!r} does not exist (check data=...)")
    conversations, errors = [], []
    for where, record in _jsonl_records(path):
        try:
            if isinstance(record, DataError):
                raise record
            conversations.append(validate_conversation(record, where))
        except DataError as exc:
            errors.append(str(exc))
    if errors:
        raise DataError(f"{len(errors)} malformed conversation(s) in {path}; nothing was trained:{listing(errors)}")
    if not conversations:
        raise DataError(f"sft data file {path} holds no conversations; {FORMAT_HINT}")
    return conversations


# -- tokenisation --------------------------------------------------------------------------------
def hermes_calls(calls: list[dict[str, Any]]) -> str:
    """Tool calls as `<tool_call>{json}</tool_call>` text, the form rlx's default parser reads back."""
    return "\n".join("<tool_call>" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                     + "</tool_call>" for c in calls)


class ConversationEncoder:
    """Renders conversations with one tokenizer's chat template into ids and assistant-only loss masks."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, end_ids: Collection[int], max_length: int) -> None:
        if not tokenizer.chat_template:
            raise ConfigError("the model's tokenizer has no chat template; SFT on conversations needs one: add "
                              "chat_template.jinja to the model folder")
        self.tokenizer, self.end_ids, self.max_length = tokenizer, set(end_ids), max_length
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        self.native_calls = "tool_calls" in template

    def _as_rendered(self, message: dict[str, Any]) -> dict[str, Any]:
        """Tool calls stay structured for a template that renders them; others get them as Hermes text
        in the content, or the template would silently drop them."""
        if self.native_calls or "tool_calls" not in message:
            return message
        rest = {k: v for k, v in message.items() if k != "tool_calls"}
        text = hermes_calls(message["tool_calls"])
        return {**rest, "content": f"{rest['content']}\n{text}" if rest["content"] else text}

    def encode(self, conversation: Conversation) -> MaskedTokens:
        chat = ChatTokens(self.tokenizer, conversation.tools)
        messages = [self._as_rendered(m) for m in conversation.messages]

        def tokens(count: int, opened: bool) -> list[int]:
            return chat.encode(chat.render(messages[:count], add_generation_prompt=opened))

        full = tokens(len(messages), False)
        mask = [0] * len(full)
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, after = tokens(k, True), tokens(k + 1, False)
            self._check_prefix(before, after, conversation.source, k, "the conversation before it, with the "
                               "assistant header,")
            self._check_prefix(after, full, conversation.source, k, "the conversation up to it")
            ends = [i for i in range(len(before), len(after)) if full[i] in self.end_ids]
            stop = ends[-1] + 1 if ends else len(after)
            mask[len(before):stop] = [1] * (stop - len(before))
        cut = len(full) > self.max_length
        return MaskedTokens(full[: self.max_length], mask[: self.max_length], conversation.source, cut)

    def _check_prefix(self, prefix: list[int], whole: list[int], where: str, index: int, what: str) -> None:
        if whole[: len(prefix)] == prefix:
            return
        at = next((i for i, (a, b) in enumerate(zip(prefix, whole)) if a != b), min(len(prefix), len(whole)))
        decode = self.tokenizer.decode
        raise DataError(
            f"{where}: the chat template is not prefix-stable at messages[{index}] (assistant): {what} renders "
            f"to tokens that the longer render does not start with (they part at token {at}: "
            f"{decode(prefix[at:at + 8])!r} against {decode(whole[at:at + 8])!r}), so the assistant's tokens "
            "cannot be told apart. Use a model whose template only appends text as messages are added, or "
            "edit its chat_template.jinja")


def encode_conversations(conversations: list[Conversation], tokenizer: PreTrainedTokenizerBase,
                         end_ids: Collection[int], max_length: int) -> list[MaskedTokens]:
    """Tokenise and mask every conversation; one DataError lists every one the template cannot mask."""
    encoder = ConversationEncoder(tokenizer, end_ids, max_length)
    encoded, errors = [], []
    for conversation in conversations:
        try:
            encoded.append(encoder.encode(conversation))
        except DataError as exc:
            errors.append(str(exc))
    if errors:
        raise DataError(f"{len(errors)} conversation(s) cannot be masked; nothing was trained:{listing(errors)}")
    return encoded


def load_sft_data(path: str | Path, tokenizer: PreTrainedTokenizerBase, end_ids: Collection[int],
                  max_length: int) -> list[MaskedTokens]:
    """Every conversation of `path`, tokenised and masked (or a DataError naming each bad row)."""
    return encode_conversations(load_conversations(path), tokenizer, end_ids, max_length)
