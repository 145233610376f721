"""The training engine: a policy model, its optimizer, micro-batched updates and checkpoints.

It knows nothing about RL. A step is `begin_step`, one `accumulate` per micro-batch (as they
arrive: the caller may stream them), then `finish_step(grad_scale)`. Losses are sums over the
micro-batch; `grad_scale` divides by the step's global token (or sequence) count once it is known,
so the update is the same whatever the micro-batch size or arrival order.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rlx.config import TrainConfig
from rlx.engines.training.batch import TokenBatch
from rlx.engines.training.forward import token_logprobs
from rlx.engines.training.schedule import lr_multiplier

if TYPE_CHECKING:  # transformers costs seconds to import; services without a model skip it
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

LossFn = Callable[[TokenBatch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]
# (model, batch, with_entropy, bf16) -> ([B, R] per-response-token output, [B, R] entropy or None)
Forward = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


class TrainingEngine:
    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: TrainConfig, temperature: float,
        forward: Forward | None = None,
    ) -> None:
        """`forward` defaults to the policy's token log-probs; a value model passes `token_values`."""
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.temperature = temperature
        self.forward: Forward = forward or functools.partial(token_logprobs, temperature=temperature)
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_multiplier(step, config.warmup_steps, config.steps, config.lr_schedule),
        )
        self.step = 0

    @torch.no_grad()
    def outputs(self, batch: TokenBatch) -> torch.Tensor:
        """The forward's per-response-token output (log-probs or values), no gradient."""
        self.model.eval()
        parts = [
            self.forward(self.model, mb, bf16=self.config.autocast_bf16)[0].cpu()
            for mb in batch.micro_batches(self.config.micro_batch_size)
        ]
        width = batch.response_width
        return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])

    def begin_step(self) -> None:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)

    def accumulate(self, micro_batch: TokenBatch, loss_fn: LossFn) -> dict[str, float]:
        """Forward and backward one micro-batch; gradients add up until `finish_step`."""
        outputs, entropy = self.forward(self.model, micro_batch, with_entropy=True, bf16=self.config.autocast_bf16)
        loss, metrics = loss_fn(micro_batch, outputs, entropy)
        loss.backward()
        return metrics

    def finish_step(self, grad_scale: float = 1.0) -> dict[str, float]:
        """Scale the accumulated gradients, clip, and take the optimizer step."""
        if grad_scale != 1.0:
            for param in self.model.parameters():
                if param.grad is not None:
                    param.grad.mul_(grad_scale)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return {"lr": lr, "grad_norm": float(grad_norm)}

    def train_step(self, batch: TokenBatch, loss_fn: LossFn, grad_scale: float = 1.0) -> dict[str, float]:
        """One optimizer step over a batch that is all here, accumulated over micro-batches."""
        self.begin_step()
        totals: dict[str, float] = {}
        for mb in batch.micro_batches(self.config.micro_batch_size):
            for key, value in self.accumulate(mb, loss_fn).items():
                totals[key] = totals.get(key, 0.0) + value
        return {**totals, **self.finish_step(grad_scale)}

    def weights(self) -> dict[str, torch.Tensor]:
        """The current weights, detached, for publishing to generation engines."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def save_checkpoint(self, directory: Path, extra_state: dict, extra_files: dict[str, bytes] | None = None) -> Path:
        """Write model (as a HF folder), optimizer, state and `extra_files`; atomic via a staging folder."""
        staging = directory.with_name(directory.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            self.export(staging)
            torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                       staging / "optimizer.pt")
            (staging / "trainer_state.json").write_text(json.dumps({"step": self.step, **extra_state}, indent=2))
            for name, content in (extra_files or {}).items():
                (staging / name).write_bytes(content)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise OSError(f"could not write checkpoint {directory}: {exc} (free disk space or set logging.run_dir)") from exc
        shutil.rmtree(directory, ignore_errors=True)
        staging.rename(directory)
        return directory

    def load_checkpoint(self, directory: Path) -> dict:
        from safetensors.torch import load_file

        state = load_file(directory / "model.safetensors")
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = {k for k in missing if k == "lm_head.weight" and self.model.config.tie_word_embeddings}
        if set(missing) - tied or unexpected:
            raise ValueError(f"checkpoint {directory} does not match the model: missing={missing} unexpected={unexpected}")
        optim = torch.load(directory / "optimizer.pt", weights_only=False)
        self.optimizer.load_state_dict(optim["optimizer"])
        self.scheduler.load_state_dict(optim["scheduler"])
        state = json.loads((directory / "trainer_state.json").read_text())
        self.step = state.pop("step")
        return state

    def export(self, directory: Path) -> Path:
        """A Hugging Face folder: loadable with `AutoModelForCausalLM.from_pretrained`."""
        directory.mkdir(parents=True, exist_ok=True)
        # The Actor's parameters share one storage per weight bucket (`flatten_parameters`), which
        # transformers would clone tensor by tensor on their device; host copies (ties kept) cost the
        # same memory on the host instead, where a GPU has none to spare.
        state = _host_copies(self.model.state_dict())
        self.model.save_pretrained(directory, state_dict=state)
        self.tokenizer.save_pretrained(directory)
        return directory


def _host_copies(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One host copy per distinct tensor; names of one tensor (tied weights) share its copy."""
    copies: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, tensor in state_dict.items():
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
        if key not in copies:
            copies[key] = tensor.detach().to("cpu", copy=True)
        out[name] = copies[key]
    return out
