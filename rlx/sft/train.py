"""`run_sft`: supervised fine-tuning on masked conversations with the RL trainer's own engine.

Each conversation is laid out as the trainer lays out a multi-turn trajectory: the tokens before
the first assistant token are the prompt, the rest is the response with its loss mask. The loss
is the mean negative log-likelihood over the masked tokens of the whole step (micro-batching does
not change it). The result is a Hugging Face folder written whole or not at all
(`rlx.checkpoints.staged_checkpoint`), which `rlx train model.path=<output>` starts from.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

from rlx.algorithms.aggregate import aggregate
from rlx.checkpoints import is_complete, staged_checkpoint
from rlx.config import TrainConfig
from rlx.engines.training import TokenBatch, TrainingEngine, collate
from rlx.engines.training.engine import LossFn
from rlx.errors import ConfigError
from rlx.models import eos_token_ids, load_pretrained, resolve_model_path
from rlx.sft.config import SFTConfig
from rlx.sft.data import MaskedTokens, encode_conversations, load_conversations

log = logging.getLogger(__name__)
CONFIG_FILE, METRICS_FILE = "sft_config.yaml", "sft_metrics.jsonl"  # beside the model in the output folder


def collate_masked(examples: list[MaskedTokens], pad_token_id: int) -> TokenBatch:
    """Split each conversation before its first trained token (at least one prompt token, which the
    first prediction needs) and collate as prompt + masked response."""
    prompts, responses, masks = [], [], []
    for example in examples:
        split = max(1, example.mask.index(1) if 1 in example.mask else len(example.ids))
        prompts.append(example.ids[:split])
        responses.append(example.ids[split:])
        masks.append([float(m) for m in example.mask[split:]])
    return collate(prompts, responses, pad_token_id, loss_masks=masks)


def masked_nll(total_tokens: float) -> LossFn:
    """The loss of one micro-batch: its share of the step's mean NLL over `total_tokens` trained tokens."""
    def loss_fn(batch: TokenBatch, logprobs: torch.Tensor, entropy: torch.Tensor | None):
        mask = batch.response_mask.to(logprobs.device)
        loss = aggregate(-logprobs, mask, "token-mean", total_tokens, float(batch.size))
        return loss, {"loss": float(loss.detach())}
    return loss_fn


def train_config(config: SFTConfig, steps: int) -> TrainConfig:
    """The training engine's settings for an SFT run of `steps` optimizer steps."""
    return TrainConfig(steps=steps, lr=config.lr, warmup_steps=config.warmup_steps, lr_schedule=config.lr_schedule,
                       weight_decay=config.weight_decay, betas=config.betas, grad_clip=config.grad_clip,
                       micro_batch_size=config.micro_batch_size, param_dtype=config.param_dtype, seed=config.seed)


def _check_output(output: Path, overwrite: bool) -> None:
    """Refuse to replace a folder this command did not write: `overwrite` covers earlier SFT results only."""
    if not output.exists() or (output.is_dir() and not any(output.iterdir())):
        return
    ours = is_complete(output) and (output / CONFIG_FILE).is_file()
    if not overwrite:
        hint = "or set overwrite=true to replace it" if ours else "(it is not an rlx sft result)"
        raise ConfigError(f"output={str(output)!r} already exists: choose another folder {hint}")
    if not ours:
        raise ConfigError(f"output={str(output)!r} exists and is not an rlx sft result (no {CONFIG_FILE}); "
                          "overwrite=true replaces only those: choose another folder")


def _steps(examples: list[MaskedTokens], config: SFTConfig) -> list[tuple[int, list[MaskedTokens]]]:
    """(epoch, conversations) of every step: each epoch in its own seeded order, cut into batches."""
    rng, steps = random.Random(config.seed), []
    for epoch in range(1, config.epochs + 1):
        order = rng.sample(examples, len(examples))
        steps += [(epoch, order[i:i + config.batch_size]) for i in range(0, len(order), config.batch_size)]
    return steps


def run_sft(config: SFTConfig, echo: Callable[[str], None] = print) -> dict:
    """Fine-tune `config.model` on `config.data`, save it to `config.output`; returns a summary with the
    loss of every step. Bad data stops the run before any training (a DataError naming file:line)."""
    output = Path(config.output)
    _check_output(output, config.overwrite)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    torch.manual_seed(config.seed)
    conversations = load_conversations(config.data)  # bad rows are reported before the model loads
    path = resolve_model_path(config.model)
    model, tokenizer = load_pretrained(path, device=config.device)
    examples = encode_conversations(conversations, tokenizer, eos_token_ids(model, tokenizer), config.max_length)
    trainable = [e for e in examples if e.trained_tokens]
    truncated, untrained = sum(e.truncated for e in examples), len(examples) - len(trainable)
    if truncated:
        log.warning("%d of %d conversations are longer than max_length=%d tokens and were cut at the end",
                    truncated, len(examples), config.max_length)
    if untrained:
        log.warning("%d conversations have no assistant token within max_length=%d and train nothing: raise "
                    "max_length", untrained, config.max_length)
    if not trainable:
        raise ConfigError(f"no conversation of {config.data} has an assistant token within max_length="
                          f"{config.max_length}: raise max_length")
    steps = _steps(trainable, config)
    engine = TrainingEngine(model, tokenizer, train_config(config, len(steps)), temperature=1.0)
    records = []
    for number, (epoch, batch_examples) in enumerate(steps, start=1):
        batch = collate_masked(batch_examples, tokenizer.pad_token_id)
        tokens = float(batch.response_mask.sum())
        metrics = engine.train_step(batch, masked_nll(tokens))
        record = {"step": number, "epoch": epoch,
                  "loss": metrics["loss"], "lr": metrics["lr"], "grad_norm": metrics["grad_norm"],
                  "trained_tokens": tokens, "conversations": len(batch_examples)}
        records.append(record)
        echo(f"step {number}/{len(steps)} epoch {record['epoch']} loss {record['loss']:.4f} "
             f"lr {record['lr']:.2e} grad_norm {record['grad_norm']:.3f} tokens {int(tokens)}")
    with staged_checkpoint(output) as staging:
        engine.export(staging)
        (staging / CONFIG_FILE).write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
        (staging / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    return {"output": str(output), "model": str(path), "steps": len(steps), "conversations": len(examples),
            "truncated": truncated, "without_trained_tokens": untrained,
            "trained_tokens_per_epoch": sum(e.trained_tokens for e in trainable),
            "losses": [r["loss"] for r in records]}
