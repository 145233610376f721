"""SFT data: the loss mask sits exactly on the assistant's tokens; bad rows and templates are named by line."""

from __future__ import annotations

import json

import pytest

from rlx.errors import ConfigError, DataError
from rlx.models.tiny import char_tokenizer
from rlx.sft import load_conversations, load_sft_config, load_sft_data
from rlx.sft.data import ConversationEncoder, validate_conversation

CALL = {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "17 + 25"}'}}
CALL_TEXT = '<tool_call>{"name": "calculator", "arguments": {"expression": "17 + 25"}}</tool_call>'
# ChatML-like: each turn ends with the end-of-turn token, then a newline the model never writes
EOT_TEMPLATE = ("{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}<eos>\n{% endfor %}"
                "{% if add_generation_prompt %}<a>{% endif %}")


def three_turns() -> dict:
    """Three assistant turns: a tool call, an answer after the tool's reply, an answer to a follow-up."""
    return {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "17+25?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "name": "calculator", "content": "42"},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "bye"},
    ]}


def expected(segments: list[tuple[str, int]], tokenizer) -> tuple[list[int], list[int]]:
    """Ids and mask built by hand, segment by segment, independently of the encoder."""
    ids, mask = [], []
    for text, trained in segments:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [trained] * len(piece)
    return ids, mask


def encode(row: dict, tokenizer, max_length: int = 1000):
    return ConversationEncoder(tokenizer, [tokenizer.eos_token_id], max_length).encode(
        validate_conversation(row, "chats.jsonl:1"))


def test_mask_covers_exactly_the_assistant_tokens_of_a_tool_conversation():
    """The tiny template ends a turn with a newline: the assistant learns its content and that newline;
    system, user and tool text and every role marker (its own `<a>` header included) are masked."""
    tokenizer = char_tokenizer()
    got = encode(three_turns(), tokenizer)
    ids, mask = expected([("<s>Be brief.\n<u>17+25?\n<a>", 0), (CALL_TEXT + "\n", 1), ("<t>42\n<a>", 0),
                          ("42\n", 1), ("<u>thanks\n<a>", 0), ("bye\n", 1)], tokenizer)
    assert got.ids == ids
    assert got.mask == mask
    assert not got.truncated and got.trained_tokens == len(CALL_TEXT) + len("42\nbye\n") + 1


def test_end_of_turn_token_is_trained_and_the_template_text_after_it_is_not():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = EOT_TEMPLATE
    got = encode(three_turns(), tokenizer)
    ids, mask = expected([("<s>Be brief.<eos>\n<u>17+25?<eos>\n<a>", 0), (CALL_TEXT + "<eos>", 1),
                          ("\n<t>42<eos>\n<a>", 0), ("42<eos>", 1), ("\n<u>thanks<eos>\n<a>", 0), ("bye<eos>", 1),
                          ("\n", 0)], tokenizer)
    assert (got.ids, got.mask) == (ids, mask)


def test_a_template_that_renders_tool_calls_gets_them_structured():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}"
        "{% for c in m.tool_calls or [] %}[{{ c.function.name }}:{{ c.function.arguments.expression }}]{% endfor %}"
        "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")
    got = encode(three_turns(), tokenizer)
    trained = tokenizer.decode([i for i, m in zip(got.ids, got.mask) if m])
    assert trained == "[calculator:17 + 25]\n42\nbye\n"  # arguments given as a JSON string arrive as an object


def test_max_length_cuts_the_end_and_says_so():
    tokenizer = char_tokenizer()
    whole = encode(three_turns(), tokenizer)
    cut = encode(three_turns(), tokenizer, max_length=30)
    assert cut.truncated and not whole.truncated
    assert (cut.ids, cut.mask) == (whole.ids[:30], whole.mask[:30])


def test_a_template_that_rewrites_earlier_text_is_an_error_naming_the_line(tmp_path):
    tokenizer = char_tokenizer()
    tokenizer.chat_template = "{{ messages | length }}" + tokenizer.chat_template  # the count changes as turns are added
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps(three_turns()) + "\n")
    with pytest.raises(DataError) as error:
        load_sft_data(data, tokenizer, [tokenizer.eos_token_id], 1000)
    message = str(error.value)
    assert f"{data}:1:" in message and "not prefix-stable at messages[2]" in message
    assert "chat_template" in message  # the fix


def test_malformed_rows_are_each_reported_with_file_line_and_fix(tmp_path):
    good = json.dumps(three_turns())
    lines = [
        good,
        "{not json",
        json.dumps({"conversation": []}),
        json.dumps({"messages": [{"role": "bot", "content": "hi"}]}),
        "",
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        json.dumps({"messages": [{"role": "user", "content": "hi", "tool_calls": [CALL]},
                                 {"role": "assistant", "content": "x"}]}),
        json.dumps({"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "x"}]}),
        json.dumps({"messages": [{"role": "user", "content": "q"},
                                 {"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}]}),
        good,
    ]
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as error:
        load_conversations(data)
    message = str(error.value)
    assert message.startswith(f"7 malformed conversation(s) in {data}")
    expectations = {
        2: "not valid JSON",
        3: "no 'messages' field",
        4: "messages[0]: role must be one of system, user, assistant, tool",
        6: "no assistant message",
        7: "messages[0]: only assistant messages make tool calls",
        8: "messages[0]: 'content' must be text",
        9: "messages[1]: a tool call must be",
    }
    reported = message.splitlines()[1:]
    assert len(reported) == len(expectations)
    for (line, reason), text in zip(expectations.items(), reported):
        assert text.strip().startswith(f"{data}:{line}: ") and reason in text, (line, text)
    for line in (1, 5, 10):  # the good rows and the blank line are not reported
        assert f"{data}:{line}:" not in message


def test_the_good_rows_load_and_an_empty_file_is_an_error(tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({**three_turns(), "tools": [{"type": "function", "function": {"name": "calculator"}}]})
                    + "\n\n" + json.dumps(three_turns()) + "\n")
    first, second = load_conversations(data)
    assert (first.source, second.source) == (f"{data}:1", f"{data}:3")
    assert first.tools and not second.tools
    assert first.messages[2]["tool_calls"][0]["function"]["arguments"] == {"expression": "17 + 25"}
    data.write_text("\n")
    with pytest.raises(DataError, match="holds no conversations"):
        load_conversations(data)


def test_config_names_unknown_and_missing_keys():
    with pytest.raises(ConfigError) as error:
        load_sft_config(None, ["data=x.jsonl", "lr=1e-4", "epoch=2"])
    assert "unknown key 'epoch'. Did you mean 'epochs'?" in str(error.value)
    assert "output is required" in str(error.value)
    config = load_sft_config(None, ["data=x.jsonl", "output=out", "lr=1e-4"])
    assert config.lr == 1e-4 and config.epochs == 1


@pytest.mark.slow
def test_smollm2_template_masks_content_and_im_end_only():
    """The real ChatML template: each assistant span is its content and <|im_end|>; a template without
    tool support gets the tools described in the system prompt, as multi-turn rollouts do."""
    from rlx.models import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path("smollm2-135m-instruct"))
    row = {**three_turns(), "tools": [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]}
    got = ConversationEncoder(tokenizer, [tokenizer.eos_token_id], 4096).encode(validate_conversation(row, "x:1"))
    spans, current = [], []
    for token, trained in zip(got.ids, got.mask):
        if trained:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    assert spans == [CALL_TEXT + "<|im_end|>", "42<|im_end|>", "bye<|im_end|>"]
    assert "<tools>" in tokenizer.decode(got.ids) and got.mask[-1] == 0  # the final newline is the template's
