"""Unit tests for rlx.data: file loading, validation errors, the prompt stream, reasoning-gym splits."""

from __future__ import annotations

import json

import pytest

from rlx.config import DataConfig
from rlx.data import DataError, PromptRow, PromptStream, check_prompt_lengths, load_splits
from rlx.data.files import load_rows
from rlx.data.gym import gym_splits
from rlx.data.prompts import encode_prompt
from rlx.errors import UserError
from rlx.models import load_tokenizer

KEYS = ("prompt", "label", "metadata")


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


# ------------------------------------------------------------------------------------------ JSONL


def test_jsonl_text_and_chat_prompts(tmp_path):
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    path = write_jsonl(tmp_path / "train.jsonl", [
        {"prompt": "What is 1+1?", "label": "2"},
        {"prompt": chat, "label": 4, "metadata": {"level": 3}},
        {"prompt": "x", "label": "y", "metadata": None, "extra": "ignored"},
    ])
    rows = load_rows(path, "jsonl", *KEYS)
    assert rows == [
        PromptRow(prompt="What is 1+1?", label="2", metadata={}),
        PromptRow(prompt=chat, label="4", metadata={"level": 3}),
        PromptRow(prompt="x", label="y", metadata={}),
    ]
    assert isinstance(rows[1].label, str)


def test_jsonl_configurable_keys(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [
        {"question": "Capital of France?", "answer": "Paris", "info": {"src": "geo"}},
        {"question": "Capital of Italy?", "answer": "Rome", "prompt": "not this one"},
    ])
    rows = load_rows(path, "jsonl", "question", "answer", "info")
    assert [r.prompt for r in rows] == ["Capital of France?", "Capital of Italy?"]
    assert [r.label for r in rows] == ["Paris", "Rome"]
    assert rows[0].metadata == {"src": "geo"}
    # with the default keys the same file has no 'label'
    with pytest.raises(DataError, match="'label'"):
        load_rows(path, "jsonl", *KEYS)


def test_jsonl_malformed_rows_are_all_reported(tmp_path):
    path = write_jsonl(tmp_path / "file.jsonl", [
        {"prompt": "a", "label": "1"},
        {"prompt": "b", "label": "2"},
        '{"prompt": "c", "label": ',  # line 3: bad JSON
        {"prompt": "d", "label": "4"},
        {"prompt": "e"},  # line 5: missing label
    ])
    with pytest.raises(DataError) as info:
        load_rows(path, "jsonl", *KEYS)
    message = str(info.value)
    assert "2 malformed row(s)" in message
    assert "file.jsonl:3" in message and "not valid JSON" in message
    assert "file.jsonl:5" in message and "missing field 'label'" in message
    assert ":1:" not in message and ":2:" not in message and ":4:" not in message
    assert isinstance(info.value, UserError)


def test_jsonl_blank_lines_keep_line_numbers(tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_text('{"prompt": "a", "label": "1"}\n\n   \n{"prompt": "", "label": "2"}\n')
    with pytest.raises(DataError) as info:
        load_rows(path, "jsonl", *KEYS)
    assert "gaps.jsonl:4" in str(info.value)


@pytest.mark.parametrize(
    "record,fragment",
    [
        ([1, 2], "expected an object"),
        ({"label": "1"}, "missing field 'prompt'"),
        ({"prompt": "   ", "label": "1"}, "non-empty"),
        ({"prompt": 5, "label": "1"}, "non-empty"),
        ({"prompt": [], "label": "1"}, "non-empty list"),
        ({"prompt": [{"role": "user"}], "label": "1"}, "messages"),
        ({"prompt": "q", "label": None}, "scalar"),
        ({"prompt": "q", "label": {"a": 1}}, "scalar"),
        ({"prompt": "q", "label": "1", "metadata": [1]}, "must be an object"),
    ],
)
def test_row_validation_errors(tmp_path, record, fragment):
    path = write_jsonl(tmp_path / "one.jsonl", [record])
    with pytest.raises(DataError) as info:
        load_rows(path, "jsonl", *KEYS)
    assert fragment in str(info.value)
    assert "one.jsonl:1" in str(info.value)


def test_many_bad_rows_are_truncated(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "q"}] * 13)
    with pytest.raises(DataError) as info:
        load_rows(path, "jsonl", *KEYS)
    message = str(info.value)
    assert "13 malformed" in message and "... and 3 more" in message
    assert "bad.jsonl:10" in message and "bad.jsonl:11" not in message


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_rows(tmp_path / "absent.jsonl", "jsonl", *KEYS)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no rows"):
        load_rows(tmp_path / "empty.jsonl", "jsonl", *KEYS)


def test_unreadable_lines_are_reported_by_line_and_the_rest_still_load(tmp_path):
    """Bytes that are not UTF-8, a 5000-digit number (past Python's int-from-text limit) and
    100000 nested lists (past the recursion limit) each become one line of the report."""
    path = tmp_path / "raw.jsonl"
    path.write_bytes(b"\n".join([
        b'{"prompt": "a", "label": "1"}',
        b'{"prompt": "caf\xe9", "label": "2"}',  # Latin-1, not UTF-8
        b'{"prompt": "c", "label": ' + b"9" * 5000 + b"}",
        b'{"prompt": "d", "label": "4", "metadata": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
        b'{"prompt": "e"}',  # a plain bad row after them is still found
        b'{"prompt": "f", "label": "6"}',
    ]) + b"\n")
    with pytest.raises(DataError) as info:
        load_rows(path, "jsonl", *KEYS)
    lines = str(info.value).splitlines()
    assert lines[0].startswith("4 malformed row(s)")
    assert "raw.jsonl:2: byte" in lines[1] and "not UTF-8" in lines[1]
    assert "raw.jsonl:3: a number is too long" in lines[2] and "write it as a string" in lines[2]
    assert "raw.jsonl:4: JSON nested too deeply" in lines[3]
    assert "raw.jsonl:5: missing field 'label'" in lines[4]
    assert len(lines) == 5 and len(str(info.value)) < 1000  # one line each: no digits, brackets or traceback
    assert info.value.__context__ is None and info.value.__cause__ is None


def test_bom_and_crlf_line_endings_load(tmp_path):
    path = tmp_path / "windows.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "label": "1"}\r\n{"prompt": "b\xc3\xa9", "label": "2"}\r\n')
    assert [row.prompt for row in load_rows(path, "jsonl", *KEYS)] == ["a", "b\u00e9"]


def test_huge_bad_values_are_quoted_short(tmp_path):
    path = write_jsonl(tmp_path / "big.jsonl", [{"prompt": "q", "label": {"k": "v" * 100_000}},
                                                {"prompt": [[[[["deep"]]]]] * 1000, "label": "1"}])
    with pytest.raises(DataError) as info:
        load_rows(path, "jsonl", *KEYS)
    assert "big.jsonl:1" in str(info.value) and "big.jsonl:2" in str(info.value)
    assert len(str(info.value)) < 600


# ---------------------------------------------------------------------------------------- parquet


def test_parquet_loading(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({
        "prompt": ["one plus one?", "two plus two?"],
        "label": ["2", "4"],
        "metadata": [{"difficulty": 1}, {"difficulty": 2}],
    })
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    rows = load_rows(path, "parquet", *KEYS)
    assert rows == [
        PromptRow(prompt="one plus one?", label="2", metadata={"difficulty": 1}),
        PromptRow(prompt="two plus two?", label="4", metadata={"difficulty": 2}),
    ]


def test_parquet_chat_prompts_and_errors(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    chat = [{"role": "user", "content": "hi"}]
    pq.write_table(pa.table({"messages": [chat, chat], "answer": [1, None]}), tmp_path / "chat.parquet")
    with pytest.raises(DataError) as info:
        load_rows(tmp_path / "chat.parquet", "parquet", "messages", "answer", "metadata")
    assert "chat.parquet:row 2" in str(info.value)
    pq.write_table(pa.table({"messages": [chat], "answer": [7]}), tmp_path / "ok.parquet")
    (row,) = load_rows(tmp_path / "ok.parquet", "parquet", "messages", "answer", "metadata")
    assert row.prompt == chat and row.label == "7"


def test_parquet_corrupt_row_group_is_reported_and_others_load(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "torn.parquet"
    labels = [str(i) for i in range(30)]
    labels[24] = None  # row 25: a plain bad row in a readable group
    pq.write_table(pa.table({"prompt": [f"q{i}" for i in range(30)], "label": labels}), path,
                   row_group_size=10, use_dictionary=False, compression="none")
    data = bytearray(path.read_bytes())
    page = pq.ParquetFile(path).metadata.row_group(1).column(0).data_page_offset
    data[page:page + 8] = b"\xff" * 8  # overwrite the page header of rows 11-20
    path.write_bytes(bytes(data))
    with pytest.raises(DataError) as info:
        load_rows(path, "parquet", *KEYS)
    message = str(info.value)
    assert message.startswith("2 malformed row(s)")
    assert "torn.parquet:rows 11-20: row group 1 is corrupt" in message and "re-export" in message
    assert "torn.parquet:row 25: 'label' must be a scalar" in message
    assert "\n" not in message.splitlines()[1]  # pyarrow's multi-line reason is folded onto one line


def test_parquet_file_that_is_not_parquet(tmp_path):
    pytest.importorskip("pyarrow")
    path = tmp_path / "train.parquet"
    path.write_bytes(b'{"prompt": "a", "label": "1"}\n')
    with pytest.raises(DataError, match=r"train.parquet: not a readable Parquet file \(.*magic bytes.*data.source"):
        load_rows(path, "parquet", *KEYS)


def test_load_splits_from_files(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"q{i}", "label": str(i)} for i in range(4)])
    held = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": f"e{i}", "label": str(i)} for i in range(5)])
    config = DataConfig(source="jsonl", path=str(train), eval_path=str(held), eval_size=3)
    train_rows, eval_rows = load_splits(config)
    assert [r.prompt for r in train_rows] == ["q0", "q1", "q2", "q3"]
    assert [r.prompt for r in eval_rows] == ["e0", "e1", "e2"]
    no_eval = DataConfig(source="jsonl", path=str(train))
    assert load_splits(no_eval)[1] == []


def test_prompts_over_max_tokens_fail_at_load_naming_rows_and_fix(tmp_path, tiny_path):
    tokenizer = load_tokenizer(tiny_path)
    prompts = ["short", "x" * 300, "fine", "y" * 400]
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": p, "label": "1"} for p in prompts])
    config = DataConfig(source="jsonl", path=str(path), max_prompt_tokens=64)
    assert len(load_splits(config)[0]) == 4  # no tokenizer: no length check
    with pytest.raises(DataError) as info:
        load_splits(config, tokenizer)
    message = str(info.value)
    longest = len(encode_prompt(PromptRow("y" * 400, "1"), tokenizer, None, True, 10_000))
    assert message.startswith(f"2 of 4 prompt(s) are longer than data.max_prompt_tokens=64 (the longest has "
                              f"{longest} tokens)")
    assert "long.jsonl:2: " in message and "long.jsonl:4: " in message and "long.jsonl:1" not in message
    assert f"Raise data.max_prompt_tokens to at least {longest}, or shorten or filter out" in message
    wide = config.model_copy(update={"max_prompt_tokens": longest})
    assert len(load_splits(wide, tokenizer)[0]) == 4
    with pytest.raises(DataError, match=r"long.jsonl:2: prompt of \d+ tokens exceeds data.max_prompt_tokens=64"):
        encode_prompt(load_splits(config)[0][1], tokenizer, None, True, 64)  # the mid-run check names it too


def test_check_prompt_lengths_names_row_index_without_a_source():
    rows = [PromptRow("one two", "1"), PromptRow("one two three four", "2"), PromptRow("a b c", "3")]

    def words(row: PromptRow) -> list[str]:
        return row.prompt.split()

    check_prompt_lengths(rows, words, max_tokens=4)
    with pytest.raises(DataError) as info:
        check_prompt_lengths(rows, words, max_tokens=2)
    assert "2 of 3 prompt(s)" in str(info.value) and "row index 1: 4 tokens" in str(info.value)


# ---------------------------------------------------------------------------------- PromptStream


ROWS = [PromptRow(prompt=f"p{i}", label=str(i)) for i in range(10)]


def prompts(taken):
    return [row.prompt for _, row in taken]


def test_stream_epoch_is_a_permutation_with_global_indices():
    stream = PromptStream(ROWS, seed=3)
    taken = stream.take(10)
    assert [index for index, _ in taken] == list(range(10))
    assert sorted(prompts(taken)) == sorted(r.prompt for r in ROWS)
    assert stream.position == 10
    nxt = stream.take(3)
    assert [index for index, _ in nxt] == [10, 11, 12]


def test_stream_same_seed_same_order_different_seed_differs():
    a = prompts(PromptStream(ROWS, seed=5).take(25))
    b = prompts(PromptStream(ROWS, seed=5).take(25))
    c = prompts(PromptStream(ROWS, seed=6).take(25))
    assert a == b
    assert a != c


def test_stream_epochs_differ():
    taken = prompts(PromptStream(ROWS, seed=0).take(30))
    epochs = [taken[0:10], taken[10:20], taken[20:30]]
    for epoch in epochs:
        assert sorted(epoch) == sorted(r.prompt for r in ROWS)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]


@pytest.mark.parametrize("start", [7, 10, 13])
def test_stream_resume_at_position(start):
    original = PromptStream(ROWS, seed=11)
    original.take(start)
    expected = original.take(5)
    resumed = PromptStream(ROWS, seed=11, position=start)
    assert resumed.take(5) == expected
    assert resumed.position == start + 5


def test_stream_resume_in_chunks_matches_one_take():
    whole = PromptStream(ROWS, seed=2).take(23)
    stream = PromptStream(ROWS, seed=2)
    pieces = stream.take(4) + stream.take(9) + PromptStream(ROWS, seed=2, position=13).take(10)
    assert pieces == whole


def test_stream_needs_rows():
    with pytest.raises(ValueError):
        PromptStream([], seed=0)


# ------------------------------------------------------------------------------- reasoning-gym


def test_gym_splits_sizes_and_disjoint_eval():
    # one-digit two-term sums: a small problem space, so the eval seed does hit train questions
    params = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    train, held_out = gym_splits("chain_sum", params, train_size=60, eval_size=20, seed=0)
    assert len(train) == 60 and len(held_out) == 20
    assert not {r.prompt for r in train} & {r.prompt for r in held_out}
    for row in train + held_out:
        assert isinstance(row.label, str) and row.label
        assert row.metadata["source_dataset"] == "chain_sum"
        assert row.metadata["question"] == row.prompt
    # deterministic for a seed, different across seeds
    again, again_eval = gym_splits("chain_sum", params, train_size=60, eval_size=20, seed=0)
    assert again == train and again_eval == held_out
    other, other_eval = gym_splits("chain_sum", params, train_size=60, eval_size=20, seed=1)
    assert [r.prompt for r in other] != [r.prompt for r in train]
    # not reasoning-gym's seed + 1, whose items are the seed's own shifted by one
    assert [r.prompt for r in other[:-1]] != [r.prompt for r in train[1:]]
    assert [r.prompt for r in other_eval[:-1]] != [r.prompt for r in held_out[1:]]


def test_load_splits_reasoning_gym():
    config = DataConfig(task="chain_sum", train_size=5, eval_size=2, seed=4)
    train, held_out = load_splits(config)
    assert len(train) == 5 and len(held_out) == 2


def test_gym_unknown_task():
    with pytest.raises(DataError, match="not_a_task"):
        gym_splits("not_a_task", {}, train_size=5, eval_size=1, seed=0)


def test_gym_bad_params():
    with pytest.raises(DataError, match="task_params"):
        gym_splits("chain_sum", {"bogus": 1}, train_size=5, eval_size=1, seed=0)
    with pytest.raises(DataError, match="task_params"):
        gym_splits("chain_sum", {"min_terms": 5, "max_terms": 2}, train_size=5, eval_size=1, seed=0)


def test_gym_eval_space_exhausted():
    params = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    with pytest.raises(DataError, match="eval_size"):
        gym_splits("chain_sum", params, train_size=3000, eval_size=100, seed=0)


def test_metadata_that_is_not_json_data_is_named_at_load(tmp_path):
    import datetime

    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlx.data.files import load_rows
    from rlx.errors import DataError

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"prompt": ["q"], "label": ["a"],
                             "metadata": [{"when": datetime.datetime(2026, 1, 1), "n": 1}]}), path)
    with pytest.raises(DataError, match=r"metadata\.when \(datetime\) is not JSON data"):
        load_rows(path, "parquet", "prompt", "label", "metadata")
