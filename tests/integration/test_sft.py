"""`run_sft` on the tiny model: the masked loss falls, masked-out targets get no gradient, the output
folder reloads and starts an RL run, and bad data or a foreign output folder stop it before training."""

from __future__ import annotations

import json

import pytest
import torch

from rlx.checkpoints import MARKER
from rlx.engines.training import TrainingEngine
from rlx.errors import ConfigError, DataError
from rlx.models import load_pretrained
from rlx.obs.metrics import read_metrics
from rlx.orchestration.colocate import run_colocate
from rlx.sft import SFTConfig, collate_masked, load_sft_data, masked_nll, run_sft
from rlx.sft.train import train_config
from tests.integration.test_colocate_loop import toy_config

pytestmark = pytest.mark.usefixtures("one_thread")


def conversation(i: int) -> dict:
    """A tool round trip: the assistant calls `echo` on the user's word, then repeats the tool's reply."""
    word = "abcdefghijklmnop"[i] * 3
    return {"messages": [
        {"role": "user", "content": f"echo {word}"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"function": {"name": "echo", "arguments": {"text": word}}}]},
        {"role": "tool", "content": word.upper()},
        {"role": "assistant", "content": f"done: {word.upper()}"},
    ]}


@pytest.fixture()
def chats(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(conversation(i)) + "\n" for i in range(16)))
    return path


def sft_config(tiny_path, chats, output, **overrides) -> SFTConfig:
    settings = {"model": str(tiny_path), "data": str(chats), "output": str(output), "epochs": 8, "batch_size": 4,
                "lr": 3e-3, "max_length": 256, **overrides}
    return SFTConfig(**settings)


def masked_loss(path, chats) -> float:
    """The mean NLL over the assistant tokens of every conversation, for the model saved at `path`."""
    model, tokenizer = load_pretrained(path)
    examples = load_sft_data(chats, tokenizer, [tokenizer.eos_token_id], 256)
    batch = collate_masked(examples, tokenizer.pad_token_id)
    logprobs = TrainingEngine(model, tokenizer, train_config(sft_config(path, chats, path), 1), 1.0).outputs(batch)
    return float(-(logprobs * batch.response_mask).sum() / batch.response_mask.sum())


def test_sft_drives_the_masked_loss_down_and_saves_a_model_rl_starts_from(tiny_path, chats, tmp_path):
    output = tmp_path / "sft"
    lines = []
    summary = run_sft(sft_config(tiny_path, chats, output), echo=lines.append)

    assert summary["steps"] == 32 and summary["conversations"] == 16 and summary["truncated"] == 0
    assert len(lines) == 32 and lines[0].startswith("step 1/32 epoch 1 loss ")
    losses = summary["losses"]
    assert losses[-1] < 0.5 * losses[0], losses
    before, after = masked_loss(tiny_path, chats), masked_loss(output, chats)
    assert after < 0.5 * before, (before, after)  # measured on the reloaded folder
    assert (output / MARKER).is_file()
    assert [r["step"] for r in map(json.loads, (output / "sft_metrics.jsonl").read_text().splitlines())] == list(
        range(1, 33))

    run_dir = run_colocate(toy_config(output, tmp_path / "rl", train__steps=1), echo=lambda _: None)
    assert any("loss" in record for record in read_metrics(run_dir))  # an RL step trained the SFT model


def test_targets_outside_the_assistant_turns_get_no_gradient(tiny_path, chats):
    """The targets (response_ids) are separate from the inputs, so a masked-out target can be changed
    without changing what the model reads: loss and gradient must not move. Changing one trained
    target must move them, or the test could not fail."""
    model, tokenizer = load_pretrained(tiny_path)
    examples = load_sft_data(chats, tokenizer, [tokenizer.eos_token_id], 256)[:4]
    batch = collate_masked(examples, tokenizer.pad_token_id)
    engine = TrainingEngine(model, tokenizer, train_config(sft_config(tiny_path, chats, tiny_path), 1), 1.0)
    tokens = float(batch.response_mask.sum())

    def loss_and_grads(targets):
        batch.response_ids = targets
        engine.begin_step()
        loss = engine.accumulate(batch, masked_nll(tokens))["loss"]
        return loss, [p.grad.clone() for p in model.parameters()]

    original = batch.response_ids.clone()
    masked_out = (batch.response_mask == 0) & (batch.attention_mask[:, -batch.response_width:] == 1)
    assert masked_out.sum() > 10  # tool replies, user text and role markers sit among the response columns
    perturbed = original.clone()
    perturbed[masked_out] = (perturbed[masked_out] + 7) % len(tokenizer)
    trained_changed = original.clone()
    row, col = batch.response_mask.nonzero()[0].tolist()
    trained_changed[row, col] = (trained_changed[row, col] + 7) % len(tokenizer)

    loss, grads = loss_and_grads(original)
    loss_perturbed, grads_perturbed = loss_and_grads(perturbed)
    loss_changed, _ = loss_and_grads(trained_changed)
    assert loss_perturbed == loss
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_perturbed))
    assert abs(loss_changed - loss) > 1e-6


def test_bad_data_or_a_foreign_output_folder_stop_before_training(tiny_path, chats, tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not an rlx sft result"):
        run_sft(sft_config(tiny_path, chats, foreign, overwrite=True), echo=lambda _: None)
    assert (foreign / "notes.txt").read_text() == "keep me"

    bad = tmp_path / "bad.jsonl"
    bad.write_text(chats.read_text() + '{"messages": [{"role": "user", "content": "no reply"}]}\n')
    output = tmp_path / "out"
    with pytest.raises(DataError, match=f"{bad}:17: no assistant message"):
        run_sft(sft_config(tiny_path, bad, output), echo=lambda _: None)
    assert not output.exists()

    run_sft(sft_config(tiny_path, chats, output, epochs=1, batch_size=16), echo=lambda _: None)
    with pytest.raises(ConfigError, match="overwrite=true"):
        run_sft(sft_config(tiny_path, chats, output, epochs=1, batch_size=16), echo=lambda _: None)
    summary = run_sft(sft_config(tiny_path, chats, output, epochs=1, batch_size=16, overwrite=True),
                      echo=lambda _: None)
    assert summary["steps"] == 1 and (output / MARKER).is_file()
