"""rlx's advantage and loss math against TRL 1.16 (called) and verl (its formulas), float64, 1e-6.

The cases are tests/parity/cases.py's list, the same `rlx bench parity` writes into
docs/algorithms.md; a `convention` case is a documented default that differs (and must), next to
the case whose rlx setting reaches the reference.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from rlx.bench.parity import TOLERANCE, Case, Result, evaluate, format_table
from tests.parity.cases import CAP, CASES, batch

DOC = Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"


def test_the_batch_holds_clipped_dual_clipped_and_above_cap_tokens():
    b = batch(0)
    ratio, on = torch.exp(b.logprobs - b.old_logprobs), b.mask > 0
    negative = b.token_advantages < 0
    assert ((ratio > 1.28) & on).any() and ((ratio < 0.8) & on).any()
    assert ((ratio > 3.0) & negative & on).any()
    assert ((torch.exp(b.old_logprobs - b.rollout_logprobs) > CAP) & on).any()
    assert len(set(b.mask.sum(1).tolist())) > 3  # ragged lengths


_RESULTS: dict[int, Result] = {}


def result_of(case: Case) -> Result:
    """Each case runs once per session, for its own test and for the docs check."""
    if id(case) not in _RESULTS:
        _RESULTS[id(case)] = evaluate(case)
    return _RESULTS[id(case)]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.name} vs {c.reference}"[:90] for c in CASES])
def test_rlx_matches_the_reference_or_differs_by_a_documented_convention(case):
    result = result_of(case)
    assert result.as_expected, (f"{case.name}: value diff {result.value_diff:.3g}, grad diff {result.grad_diff}, "
                                f"expected {case.expect} within {TOLERANCE}")


def _without_measurements(table: str) -> list[list[str]]:
    """The table's rows less the two measured columns, whose last digits may vary with the machine."""
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ")]
    return [row[:3] + row[5:] for row in rows]


def test_the_parity_table_in_the_docs_is_current():
    text = DOC.read_text()
    section = re.search(r"<!-- bench:parity -->\n`[^\n]*\n\n(.*?)\n<!-- /bench:parity -->", text, re.DOTALL)
    assert section, "docs/algorithms.md has no parity table: run `rlx bench parity`"
    fresh = format_table([result_of(c) for c in CASES])
    assert _without_measurements(section.group(1)) == _without_measurements(fresh), "stale: run `rlx bench parity`"
