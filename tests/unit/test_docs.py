"""The docs cannot rot: no link leaves the repository, the examples of docs/extending.md run, and
the bus-field table of docs/architecture.md matches the role plan."""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

from rlx.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, LossInputs
from rlx.algorithms.losses import policy_loss_of
from rlx.bus.core import BusIndex
from rlx.config import RunConfig, build_config, parse_yaml
from rlx.data import PromptRow, load_splits
from rlx.data.sample import Sample
from rlx.engines.generation import EngineSpec, GenerationRequest
from rlx.generation_engines import GENERATION_ENGINES
from rlx.orchestration.builder import build_reward_role, build_rollout, sampling_params
from rlx.orchestration.plan import FIELDS
from rlx.rewards import build_judge_parser

ROOT = Path(__file__).resolve().parents[2]
EXTENDING = ROOT / "docs" / "extending.md"
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target "title")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)  # [name]: target
HTML_LINK = re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']""")
CODE = re.compile(r"^```.*?^```|`[^`\n]*`", re.DOTALL | re.MULTILINE)  # fenced blocks, inline code
EXAMPLE = re.compile(r"<!-- example: (\S+) -->\s*\n```\w*\n(.*?)\n```", re.DOTALL)


def markdown_files() -> list[Path]:
    return sorted([*ROOT.glob("*.md"), *ROOT.glob("docs/**/*.md")])


def link_targets(text: str) -> list[str]:
    """Targets of inline, reference and HTML links; code (fenced or inline) holds no links."""
    prose = CODE.sub("", text)
    return [m.group(1) for pattern in (LINK, REFERENCE, HTML_LINK) for m in pattern.finditer(prose)]


def link_problem(doc: Path, target: str) -> str | None:
    """Why `target`, a link in `doc`, is not a file inside the repository (None: it is, or a web link)."""
    if re.match(r"^(https?|mailto):", target) or target.startswith("#"):
        return None
    path = target.split("#", 1)[0]
    if re.match(r"^([a-zA-Z]+:|/|~|\\)", path):
        return f"{target!r} is an absolute path or URL scheme: link a file of the repository, relative to {doc.name}"
    resolved = (doc.parent / path).resolve()
    if not resolved.is_relative_to(ROOT):
        return f"{target!r} leads outside the repository: link docs/architecture.md or another file inside it"
    if not resolved.exists():
        return f"{target!r} does not exist: fix the path or remove the link"
    return None


def test_markdown_files_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in markdown_files()}
    assert {"README.md", "docs/architecture.md", "docs/extending.md", "docs/reliability.md"} <= names


def test_no_markdown_link_leaves_the_repository():
    problems = [f"{doc.relative_to(ROOT)}: {problem}" for doc in markdown_files()
                for target in link_targets(doc.read_text()) if (problem := link_problem(doc, target))]
    assert problems == []


@pytest.mark.parametrize("target", ["../shared/DESIGN.md", "/etc/passwd", "../../x.md", "file:///tmp/a.md",
                                    "~/notes.md", "missing.md"])
def test_link_check_rejects_links_out_of_the_repository(target):
    assert link_problem(ROOT / "docs" / "x.md", target) is not None


def test_link_check_finds_every_link_form():
    text = '[a](../x.md) ![b](<img.png> "t")\n[ref]: ../y.md\n<a href="../z.md">z</a> `[c](not-a-link)`'
    assert link_targets(text) == ["../x.md", "img.png", "../y.md", "../z.md"]
    assert link_targets("[`../shared/D.md`](../shared/D.md)\n```\n[e](in-a-fence)\n```") == ["../shared/D.md"]


def test_link_check_accepts_links_inside_the_repository():
    doc = ROOT / "docs" / "x.md"
    for target in ("architecture.md#layers", "../README.md", "https://example.org/a", "#staleness"):
        assert link_problem(doc, target) is None


def test_architecture_field_table_matches_the_plan():
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("### Bus fields", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()
            if line.startswith("| `")]
    documented = [(name.strip("`"), writer, tuple(readers.split(", "))) for name, writer, readers, _ in rows]
    assert documented == [(f.name, f.writer, f.readers) for f in FIELDS]


# --- the examples of docs/extending.md, each run through the path rlx itself takes ---


def examples() -> dict[str, str]:
    return {name: code for name, code in EXAMPLE.findall(EXTENDING.read_text())}


def test_every_example_has_a_check():
    assert set(examples()) == {"my_rewards.py", "sample_reward.yaml", "group_reward.yaml", "my_judges.py",
                               "judge.yaml", "my_engines.py", "engine.yaml", "my_losses.py", "loss.yaml",
                               "my_advantages.py", "my_samplers.py", "make_data.py", "data.yaml",
                               "my_agents.py", "agent.yaml"}


@pytest.fixture()
def doc_examples(tmp_path, monkeypatch):
    """The examples saved as files in tmp_path (the working directory, on sys.path). The registries
    they add to are restored afterwards, and their modules forgotten, so each test imports afresh."""
    for registry in (GENERATION_ENGINES, POLICY_LOSSES, ADVANTAGE_ESTIMATORS):
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))
    modules = {Path(name).stem for name in examples() if name.endswith(".py")}
    for name, code in examples().items():
        (tmp_path / name).write_text(code + "\n")
    tmp_path.chmod(0o755)  # on a root host the reward pool's processes run as nobody: they import from here
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for module in modules:
        sys.modules.pop(module, None)


def example_config(name: str, **extra: dict) -> RunConfig:
    return build_config({**parse_yaml(examples()[name]), **extra})


def test_environment_and_tool_examples_play_through_the_agent_setup(doc_examples):
    from rlx.agents.setup import environment_factory
    from rlx.agents.tools import ToolBox, build_tool

    env = environment_factory(example_config("agent.yaml"), None)()
    assert env.reset(PromptRow("", "30"))[0]["content"] == "Guess my number between 1 and 50."
    assert env.step("is it 20?").observation == [{"role": "user", "content": "higher"}]
    assert env.step("30").done
    box = ToolBox([build_tool("my_agents:Convert")])
    assert box.call("convert", {"value": 2, "source": "km", "target": "m"}).text == "2000"
    unknown = box.call("convert", {"value": 2, "source": "km", "target": "parsec"})
    assert unknown.outcome == "error" and "unknown unit 'parsec'" in unknown.text


def test_sample_reward_example_scores_in_the_reward_pool(doc_examples):
    role = build_reward_role(example_config("sample_reward.yaml"))
    try:
        samples = [Sample(uid=0, group_id=0, response_text="the answer is 5", label="5"),
                   Sample(uid=1, group_id=0, response_text="no idea", label="5"),
                   Sample(uid=2, group_id=0, response_text="5 " * 12, label="5", metadata={"max_words": 10})]
        scored = role.score(samples)
    finally:
        role.close()
    assert [s.reward for s in scored] == pytest.approx([1.0, 0.0, 0.98])
    assert all(s.reward_error is None for s in scored)


def test_async_group_reward_example_scores_whole_groups(doc_examples):
    role = build_reward_role(example_config("group_reward.yaml", rollout={"n": 3}))
    try:
        texts = ["x = 12", "it is 12", "13"]
        scored = role.score([Sample(uid=i, group_id=7, response_text=t, label="12") for i, t in enumerate(texts)])
    finally:
        role.close()
    assert [s.reward for s in scored] == [1.0, 0.5, 0.0]


def test_judge_parser_example_reads_grades_and_rejects_other_text(doc_examples):
    config = example_config("judge.yaml")
    parse, top = build_judge_parser(config.reward.judge.parser), config.reward.judge.max_score
    assert [parse(text, top) for text in ("Grade: A", "grade: b.", "GRADE:C")] == [1.0, 0.5, 0.0]
    with pytest.raises(ValueError, match="no grade"):
        parse("I think it is fine", top)
    assert "{question}" in config.reward.judge.prompt


def test_engine_example_serves_the_rollout_role(doc_examples, tiny_path):
    importlib.import_module("my_engines")  # registration first, as the doc says: the config checks the name
    config = example_config("engine.yaml")
    rollout = build_rollout(config, tiny_path)
    row = PromptRow(prompt="1+6=", label="7")
    prompt_ids = rollout.tokenizer.encode("1+6=", add_special_tokens=False)
    samples = list(rollout.generate([(0, row, prompt_ids)], config.rollout.n, sampling_params(config, seed=0)))
    assert [s.response_text for s in samples] == ["7", "7"]
    assert {s.group_id for s in samples} == {0} and all(s.behavior_version == 0 for s in samples)
    rollout.load_weights({}, 3)
    assert rollout.engine.weight_version == 3


def test_engine_example_refills_until_no_requests_come(doc_examples, tiny_path):
    importlib.import_module("my_engines")
    engine, _ = GENERATION_ENGINES.get("scripted")(EngineSpec(tiny_path, max_batch_size=4))
    batches = [[_request(1)], []]
    results = list(engine.stream([_request(0)], sampling_params(example_config("engine.yaml"), seed=0),
                                 refill=lambda free: batches.pop(0)))
    assert [r.request_id for r in results] == [0, 1] and batches == []


def _request(request_id: int) -> GenerationRequest:
    return GenerationRequest(request_id=request_id, prompt_ids=[5, 6])


def test_loss_example_is_selected_by_the_config(doc_examples):
    config = example_config("loss.yaml").algorithm.loss  # imports my_losses, which registers the loss
    loss = policy_loss_of(config)
    logprobs = torch.log(torch.tensor([[1.0, 2.0, 1.2]]))  # ratios 1, 2, 1.2 against old log-probs of 0
    inputs = LossInputs(logprobs, torch.zeros(1, 3), torch.tensor([[1.0, -2.0, 0.5]]), torch.ones(1, 3))
    terms = loss(inputs, config)
    assert terms.loss[0].tolist() == pytest.approx([-1.0, 3.0, -0.6])  # -min(r, 1.5) * A
    assert terms.cut.tolist() == [[0.0, 1.0, 0.0]]
    with_reference = loss(dataclasses.replace(inputs, ref_logprobs=torch.zeros(1, 3)), config)
    # + 0.1 (log pi - log pi_ref), log pi_ref = 0
    assert with_reference.loss[0].tolist() == pytest.approx([-1.0, 3.0 + 0.1 * math.log(2.0), -0.6 + 0.1 * math.log(1.2)])


def test_advantage_example_ranks_within_groups(doc_examples):
    importlib.import_module("my_advantages")
    estimator = ADVANTAGE_ESTIMATORS.get("group_rank")
    advantages = estimator(torch.tensor([0.2, 0.9, 0.5, 3.0]), torch.tensor([0, 0, 0, 1]), norm_std=True)
    assert advantages.tolist() == pytest.approx([-1.0, 1.0, 0.0, 0.0])


def test_sampler_example_takes_the_shortest_ready_rows_from_the_bus(doc_examples):
    sampler = importlib.import_module("my_samplers").ShortestFirstSampler()
    index = BusIndex()
    index.add_rows({"x": [1, 2, 3]}, group_ids=[0, 0, 1], num_tokens=[5, 1, 3])
    assert index.take("train", ["x"], 4, sampler) == []  # too few rows and not partial: wait
    assert sorted(index.take("train", ["x"], 2, sampler)) == [1, 2]


def test_data_example_loads_as_prompt_rows(doc_examples):
    runpy.run_path(str(doc_examples / "make_data.py"))  # writes arithmetic.jsonl into the working directory
    train, held_out = load_splits(example_config("data.yaml").data)
    assert [row.label for row in train] == ["5", "3", "12"]
    assert train[0].question == "What is 2 + 3?" and train[0].metadata == {"kind": "arithmetic"}
    assert len(held_out) == 1


def test_examples_leave_the_registries_as_they_found_them():
    """Runs after the example tests (file order): their registrations must not leak into other tests."""
    assert "scripted" not in GENERATION_ENGINES
    assert "capped_ratio" not in POLICY_LOSSES and "group_rank" not in ADVANTAGE_ESTIMATORS
