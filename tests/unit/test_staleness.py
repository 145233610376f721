"""The staleness bound holds for every trained sample under random completion orders."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rlx.orchestration.staleness import StalenessGate


def test_admission_by_hand():
    gate = StalenessGate(max_staleness=1, groups_per_step=4)
    assert gate.groups_allowed(groups_started=0, version=0) == 8  # (0 + 1 + 1) * 4
    assert gate.groups_allowed(groups_started=8, version=0) == 0
    assert gate.groups_allowed(groups_started=8, version=1) == 4
    assert StalenessGate(0, 4).groups_allowed(4, 0) == 0  # on-policy: wait for the step
    assert gate.is_fresh(behavior_version=2, trainer_version=3) and not gate.is_fresh(1, 3)


@settings(max_examples=200, deadline=None)
@given(
    max_staleness=st.integers(0, 3),
    groups_per_step=st.integers(1, 4),
    choices=st.lists(st.integers(0, 10**6), min_size=1, max_size=300),
)
def test_trained_samples_never_exceed_the_bound(max_staleness, groups_per_step, choices):
    """Simulate rollout, out-of-order completion and training; check every trained sample."""
    gate = StalenessGate(max_staleness, groups_per_step)
    version, started, in_flight, finished, trained_in_step = 0, 0, [], [], 0
    for choice in choices:
        action = choice % 3
        if action == 0 and gate.groups_allowed(started, version) > 0:
            in_flight.append(version)  # a group starts with the current weights
            started += 1
        elif action == 1 and in_flight:
            finished.append(in_flight.pop(choice % len(in_flight)))  # any group may finish first
        elif action == 2 and finished:
            behavior = finished.pop(choice % len(finished))  # the trainer takes any finished group
            if gate.is_fresh(behavior, version):
                assert version - behavior <= max_staleness
                trained_in_step += 1
                if trained_in_step == groups_per_step:
                    version, trained_in_step = version + 1, 0
        assert started <= (version + max_staleness + 1) * groups_per_step
