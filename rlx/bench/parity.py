"""rlx's advantage and loss math against TRL's and verl's, on identical float64 inputs (`rlx bench parity`).

The comparison cases live in `tests/parity/cases.py` (the references are test code: TRL is called
as a library, verl's formulas are written there from their definitions), and this module runs the
same list for the pytest suite and for the table in docs/algorithms.md, so the two cannot drift.
A case gives the largest absolute difference of the loss (or advantage) values and of the
gradients; `match` rows must stay within TOLERANCE, `convention` rows show a documented default
that differs (and must differ), next to the row whose rlx setting reaches the reference.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

TOLERANCE = 1e-6
Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Case:
    """One pair: rlx (with `settings`) against `reference`; `run` returns both sides' named tensors
    (loss values, advantages, gradients), compared key by key."""

    name: str
    reference: str
    settings: str
    run: Callable[[int], tuple[Tensors, Tensors]]
    expect: Literal["match", "convention"] = "match"


@dataclass(frozen=True)
class Result:
    case: Case
    value_diff: float  # max |rlx - reference| over the values, over seeds
    grad_diff: float | None  # over the gradients; None where nothing is differentiated

    @property
    def within(self) -> bool:
        return self.value_diff <= TOLERANCE and (self.grad_diff is None or self.grad_diff <= TOLERANCE)

    @property
    def verdict(self) -> str:
        if self.case.expect == "match":
            return "match" if self.within else "**MISMATCH**"
        return "differs (convention)" if not self.within else "**expected a difference**"

    @property
    def as_expected(self) -> bool:
        return self.within == (self.case.expect == "match")


def max_diffs(ours: Tensors, theirs: Tensors) -> tuple[float, float | None]:
    """(max |difference| of the non-gradient entries, of the `grad*` entries or None without any)."""
    if ours.keys() != theirs.keys():
        raise ValueError(f"the two sides return different quantities: {sorted(ours)} against {sorted(theirs)}")
    values, grads = [0.0], []
    for key in ours:
        diff = (ours[key].detach().double() - theirs[key].detach().double()).abs().max().item()
        (grads if key.startswith("grad") else values).append(diff)
    return max(values), (max(grads) if grads else None)


def evaluate(case: Case, seeds: tuple[int, ...] = (0, 1, 2)) -> Result:
    diffs = [max_diffs(*case.run(seed)) for seed in seeds]
    grads = [g for _, g in diffs if g is not None]
    return Result(case, max(v for v, _ in diffs), max(grads) if grads else None)


def load_cases() -> list[Case]:
    """The case list of tests/parity/cases.py, from the checkout this rlx was imported from."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "tests" / "parity" / "cases.py").exists():
        raise RuntimeError(f"rlx bench parity runs from a checkout of rlx: no tests/parity/cases.py under {root}")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module("tests.parity.cases").CASES


def _number(x: float | None) -> str:
    """Differences below 1e-12 are float64 rounding, which may vary with the machine's kernels."""
    if x is None:
        return "n/a"
    return "0" if x == 0 else "< 1e-12" if x < 1e-12 else f"{x:.1e}"


def format_table(results: list[Result]) -> str:
    lines = [(f"Float64, seeds 0-2, tolerance {TOLERANCE:g}; max |rlx - reference| of the values (loss or "
              "advantages) and of the gradients w.r.t. log-probs (and entropies, values where they enter)."), "",
             "| compared | reference | rlx settings | max diff value | max diff grad | verdict |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.case.name} | {r.case.reference} | {r.case.settings} | {_number(r.value_diff)} | "
                     f"{_number(r.grad_diff)} | {r.verdict} |")
    return "\n".join(lines)


def run_parity_benchmark() -> list[Result]:
    torch.set_num_threads(1)
    return [evaluate(case) for case in load_cases()]
