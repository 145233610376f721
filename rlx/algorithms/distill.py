"""On-policy distillation: the student is rewarded per token for agreeing with the teacher."""

from __future__ import annotations

import torch


def reverse_kl_advantages(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                          task_advantages: torch.Tensor | None = None, coef: float = 1.0) -> torch.Tensor:
    """A_t = coef (log pi_teacher(y_t) - log pi_student(y_t)) [+ task advantage], detached.

    On the student's own samples, the expectation of -A_t/coef is the reverse KL(student || teacher),
    so maximising A drives the reverse KL down."""
    advantages = coef * (teacher_logprobs - student_logprobs).detach()
    return advantages if task_advantages is None else advantages + task_advantages
