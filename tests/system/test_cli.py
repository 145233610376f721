"""The `rlx` command line, run as a user runs it: in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from transformers import AutoModelForCausalLM

from rlx.checkpoints import exportable
from rlx.cli import main
from rlx.config import TrainConfig
from rlx.engines.training.engine import TrainingEngine
from rlx.models import load_pretrained

ROOT = Path(__file__).resolve().parents[2]


def rlx(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "rlx.cli", *map(str, args)], check=False, cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_doctor_prints_resolved_config_with_overrides():
    out = rlx("doctor", "examples/chain_sum_smollm2.yaml", "train.lr=1e-6", "rollout.n=4")
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert resolved["train"]["lr"] == 1e-6 and resolved["rollout"]["n"] == 4
    assert resolved["data"]["task_params"]["max_digits"] == 2


def test_doctor_rejects_unknown_key_and_bad_value():
    out = rlx("doctor", "examples/chain_sum_smollm2.yaml", "train.lrr=1", "rollout.temperature=-2")
    assert out.returncode == 2
    assert "train.lrr" in out.stderr and "train.lr" in out.stderr
    assert "rollout.temperature = -2" in out.stderr and "greater than 0" in out.stderr


def test_every_example_config_is_valid(monkeypatch, capsys):
    """In this process (the two tests above run `rlx doctor` as a user does): a subprocess per example
    would pay the interpreter's and the libraries' start-up nine times over."""
    monkeypatch.chdir(ROOT)
    for example in sorted((ROOT / "examples").glob("*.yaml")):
        code = main(["doctor", str(example)])
        assert code == 0 and "# config OK" in capsys.readouterr().err, example


def test_bad_data_row_stops_the_run_before_it_starts(tmp_path, tiny_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "ok", "label": "1"}\n{"prompt": "no label"}\n{oops\n')
    run_dir = tmp_path / "run"
    out = rlx("train", f"model.path={tiny_path}", "data.source=jsonl", f"data.path={data}",
              f"logging.run_dir={run_dir}")
    assert out.returncode == 2
    assert f"{data}:2" in out.stderr and "'label'" in out.stderr
    assert f"{data}:3" in out.stderr and "not valid JSON" in out.stderr
    assert not (run_dir / "checkpoints").exists()


def test_train_export_and_plot_from_the_command_line(tmp_path, tiny_path):
    data = tmp_path / "toy.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(20)))
    run_dir = tmp_path / "run"
    args = ["train", f"model.path={tiny_path}", "data.source=jsonl", f"data.path={data}", f"data.eval_path={data}",
            "data.eval_size=4", "reward.name=exact_match", "rollout.n=2", "rollout.prompts_per_step=2",
            "rollout.max_new_tokens=4", "train.steps=2", f"logging.run_dir={run_dir}", "logging.progress_bar=false"]
    out = rlx(*args)
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward_mean" in r] == [1, 2]
    evaluated = rlx("eval", run_dir)
    assert evaluated.returncode == 0, evaluated.stderr
    report = json.loads(evaluated.stdout)
    assert report["model"].endswith("step_000002") and report["eval_size"] == 4 and 0 <= report["eval_accuracy"] <= 1
    again = rlx(*args)
    assert again.returncode == 2 and "--resume" in again.stderr
    exported = tmp_path / "hf"
    assert rlx("export", run_dir, exported).returncode == 0
    assert AutoModelForCausalLM.from_pretrained(exported).config.vocab_size > 0
    assert all(exportable(p.name) for p in exported.iterdir()) and not (exported / "optimizer.pt").exists()
    (run_dir / "training.png").unlink()
    assert rlx("plot", run_dir).returncode == 0 and (run_dir / "training.png").exists()


def test_an_old_run_directory_names_the_converter_which_converts_it(tmp_path, tiny_path):
    """A run directory as an older rlx left it: no completion markers, no .rlx-run."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"model:\n  path: {tiny_path}\n")
    model, tokenizer = load_pretrained(tiny_path)
    TrainingEngine(model, tokenizer, TrainConfig(), 1.0).write_checkpoint(run_dir / "checkpoints/step_000003",
                                                                         {"loop_step": 3})
    refused = rlx("export", run_dir, tmp_path / "hf")
    assert refused.returncode == 2 and f"rlx convert-run {run_dir}" in refused.stderr
    overwrite = rlx("train", f"logging.run_dir={run_dir}", "--overwrite")
    assert overwrite.returncode == 2 and "rlx did not create it" in overwrite.stderr
    assert "TRUSTING THEM" in rlx("convert-run", "--help").stdout
    converted = rlx("convert-run", run_dir)
    assert converted.returncode == 0 and "step_000003" in converted.stdout, converted.stderr
    assert rlx("export", run_dir, tmp_path / "hf").returncode == 0 and (tmp_path / "hf/model.safetensors").exists()


def test_models_list_shows_builtins():
    out = rlx("models", "list")
    assert out.returncode == 0
    assert "smollm2-135m-instruct" in out.stdout and "tiny-char" in out.stdout


def test_a_file_in_the_working_directory_never_shadows_an_installed_module(tmp_path):
    """The `rlx` command puts its working directory last on the import path (L10): a stray
    transformers.py there is not imported in place of the library."""
    (tmp_path / "transformers.py").write_text("raise SystemExit('the working directory shadowed transformers')")
    out = subprocess.run([Path(sys.executable).parent / "rlx", "models", "list"], check=False, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "tiny-char" in out.stdout, out.stderr
