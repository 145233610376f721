"""Training engine: per-token log-probs, micro-batched updates, checkpoints, HF export."""

from rlx.engines.training.batch import TokenBatch, collate
from rlx.engines.training.engine import TrainingEngine
from rlx.engines.training.forward import token_logprobs

__all__ = ["TokenBatch", "TrainingEngine", "collate", "token_logprobs"]
