"""Unit tests for rlx.data: file loading, validation errors, the prompt stream, reasoning-gym splits."""

from __future__ import annotations

import json

import pytest

from rlx.config import DataConfig
from rlx.data import DataError, PromptRow, PromptStream, load_splits
from rlx.data.files import load_rows
from rlx.data.gym import gym_splits
from rlx.errors import UserError

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


def test_load_splits_from_files(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"q{i}", "label": str(i)} for i in range(4)])
    held = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": f"e{i}", "label": str(i)} for i in range(5)])
    config = DataConfig(source="jsonl", path=str(train), eval_path=str(held), eval_size=3)
    train_rows, eval_rows = load_splits(config)
    assert [r.prompt for r in train_rows] == ["q0", "q1", "q2", "q3"]
    assert [r.prompt for r in eval_rows] == ["e0", "e1", "e2"]
    no_eval = DataConfig(source="jsonl", path=str(train))
    assert load_splits(no_eval)[1] == []


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
    params = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)
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
    other, _ = gym_splits("chain_sum", params, train_size=60, eval_size=20, seed=1)
    assert [r.prompt for r in other] != [r.prompt for r in train]


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
    params = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    with pytest.raises(DataError, match="eval_size"):
        gym_splits("chain_sum", params, train_size=3000, eval_size=100, seed=0)
