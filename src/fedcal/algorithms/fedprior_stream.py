"""fedprior's server update from the replies' sums (issue 25.1; :mod:`fedcal.engine.streamed`).

fedprior's M-step (module doc of :mod:`fedcal.algorithms.fedprior`, step 2) reads its
replies only as sums over the units — Σ m_i, Σ (m_i m_iᵀ + V_i), the GLS terms, Σ RSS, Σ n,
the Gram and support sums, every candidate's — and the unit count N. ``robust = "full"``
weights each unit by its leave-one-out distance (:mod:`fedcal.algorithms.fedprior_robust`),
from its m_i and S_i: a streamed round keeps those per unit (:attr:`outlier_inputs`) and
corrects the sums by Σ (w_i − 1)·reply_i. The calibrated interval's probe (I2 of
:mod:`fedcal.algorithms.fedprior_interval`: the smallest design, ties by the canonical
order of the units' m_i) is one unit's upload, not a sum: a streamed round keeps each
unit's key (its design's rows n and m_i, :attr:`pick_inputs`), chooses the unit with
:meth:`pick_reply` among the used units, and takes the probe leaves (:attr:`picked_leaves`)
from that unit's reply; the hold-out counts are sums. A subclass with its own
``server_update`` (fedprior_drift) reads more of each unit's reply and is refused.

:class:`StreamedSums` is a part of :class:`~fedcal.algorithms.fedprior.FedPrior` (its
``streamed``), declared by the four settings that decide whether a round may be streamed; the
engine's hooks (``server_update_sums``, ``streaming_refused``, …) are FedPrior's and call it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fedcal.algorithms.fedprior_interval import probe_unit
from fedcal.core.tree import Tree


def canonical_order(mean: Tensor) -> Tensor:
    """The units' canonical order: lexicographic in m_i (first coordinate first; stable), so
    that the sums' rounding and the probe's ties do not depend on arrival order."""
    return torch.from_numpy(np.lexsort(mean.numpy().T[::-1]).copy())


@dataclass(frozen=True)
class StreamedSums:
    """Whether and how fedprior's M-step runs from the replies' sums (module doc), declared by
    the settings that decide it: ``robust`` (per-unit M-step weights), ``interval`` (the
    probe's one-unit leaves), ``noise_shape`` and ``noise_tail`` (per-unit clipped
    evidence)."""

    robust: str
    interval: str
    noise_shape: str
    noise_tail: str

    def refused(self, name: str, own_update: bool) -> str | None:
        """None when the M-step from the sums equals ``server_update``; else why not.
        ``own_update``: the algorithm's server update is not fedprior's (a subclass's own)."""
        if own_update:
            return f"{name}: its server update is its own (per-unit replies)"
        if self.noise_shape != "constant" or self.noise_tail != "gaussian":
            return f"{name}: the noise model's evidence is clipped unit by unit"
        return None

    @property
    def outlier_inputs(self) -> tuple[str, ...]:
        """The reply leaves the M-step weights read per unit (m_i, S_i): kept per unit
        by a streamed round when ``robust = "full"``, (p + p²) numbers a unit."""
        return ("mean", "second") if self.robust == "full" else ()

    @property
    def picked_leaves(self) -> tuple[str, ...]:
        """The reply leaves that are one unit's, not summed: the probe candidate (I2)."""
        return ("interval/x", "interval/b", "interval/n") if self.interval == "calibrated" else ()

    @property
    def pick_inputs(self) -> tuple[str, ...]:
        """The reply leaves :meth:`pick_reply` reads per unit (n_i and m_i: p + 1 numbers)."""
        return ("interval/n", "mean") if self.interval == "calibrated" else ()

    @staticmethod
    def pick_reply(keys: Tree) -> int | None:
        """Which used unit's :attr:`picked_leaves` the server reads (row of ``keys``, the
        :attr:`pick_inputs` of the used units in client order): the probe's unit as
        ``server_update`` chooses it (:func:`~fedcal.algorithms.fedprior_interval.probe_unit`
        in the canonical order); None: no unit uploads a design (the leaves are zero)."""
        order = canonical_order(keys["mean"])
        j = probe_unit(keys["interval"]["n"][order])
        return None if j is None else int(order[j])

    @staticmethod
    def as_cohort(sums: Tree) -> Tree:
        """Σ_i reply_i (no clients axis) as a cohort of one, so that the M-step from the sums
        is ``server_update``'s code (N then replaces the cohort's size)."""
        return {
            k: StreamedSums.as_cohort(v) if isinstance(v, dict) else v.unsqueeze(0)
            for k, v in sums.items()
        }
