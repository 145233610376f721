"""Staleness control: admission of new prompt groups, and the check on samples at training time.

Admission: the Rollout may start group number k (0-based) only while
`k < (v + max_staleness + 1) * groups_per_step`, v being the trainer's published version. Groups
that finish out of order could still be trained later than that bound allows, so the trainer also
drops any sample with `|v - behavior_version| > max_staleness` (counted, with the reason "stale").
Together they guarantee the bound for every trained sample. A sample can be newer than the trainer
only after a global recovery rolled the Actor back to a checkpoint: it was sampled from weights
that no longer exist, and it is trained on only if it is as close to the trainer as a stale one
may be.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessGate:
    max_staleness: int
    groups_per_step: int

    def groups_allowed(self, groups_started: int, version: int) -> int:
        """How many more groups may start now."""
        return max(0, (version + self.max_staleness + 1) * self.groups_per_step - groups_started)

    def is_fresh(self, behavior_version: int, trainer_version: int) -> bool:
        return abs(trainer_version - behavior_version) <= self.max_staleness
