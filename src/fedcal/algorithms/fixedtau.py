"""FedAvg with a fixed number of local steps τ under AFL-CSEM's resource budget (seed 004).

The seed's first baseline: McMahan et al.'s FedAvg "with τ (τ ≠ 1) fixed",
τ = 10 ("empirically a good non-adaptive value" in the seed). Everything but
the choice of τ is AFL-CSEM's (:mod:`fedcal.algorithms.aflcsem`): τ local
minibatch steps (5), Q-weighted aggregation (7), the same cost accounting
(9)–(11), the same budget stop and the same best-model rule (8), so that a
comparison at equal budget isolates the control of τ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import Field

from fedcal.algorithms.aflcsem import AFLCSEM
from fedcal.core.tree import Tree


@dataclass(frozen=True)
class FixedTau(AFLCSEM):
    """``initial_tau`` is the fixed τ (seed: 10)."""

    initial_tau: Annotated[int, Field(ge=1)] = 10

    name = "fixedtau"

    def next_tau(self, server: Tree, estimates: Tree, step_cost: float) -> int:
        return self.initial_tau
