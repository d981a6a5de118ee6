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
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from fedcal.algorithms.fedprior_interval import probe_unit
from fedcal.core.tree import Tree


def canonical_order(mean: Tensor) -> Tensor:
    """The units' canonical order: lexicographic in m_i (first coordinate first; stable), so
    that the sums' rounding and the probe's ties do not depend on arrival order."""
    return torch.from_numpy(np.lexsort(mean.numpy().T[::-1]).copy())


class StreamedSums:
    """:meth:`server_update_sums` and when it is refused; a mixin of ``FedPrior``."""

    def streaming_refused(self) -> str | None:
        """None when :meth:`server_update_sums` equals ``server_update``; else why not."""
        # the server update in use must be the one of the class that mixes these sums in
        owner = next(c for c in type(self).__mro__ if "server_update" in vars(c))
        if StreamedSums not in owner.__bases__:
            return f"{self.name}: its server update is its own (per-unit replies)"
        if self.noise_shape != "constant" or self.noise_tail != "gaussian":
            return f"{self.name}: the noise model's evidence is clipped unit by unit"
        return None

    @property
    def outlier_inputs(self) -> tuple[str, ...]:
        """The reply leaves :meth:`outlier_weights` reads per unit (m_i, S_i): kept per unit
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

    def pick_reply(self, keys: Tree) -> int | None:
        """Which used unit's :attr:`picked_leaves` the server reads (row of ``keys``, the
        :attr:`pick_inputs` of the used units in client order): the probe's unit as
        ``server_update`` chooses it (:func:`~fedcal.algorithms.fedprior_interval.probe_unit`
        in the canonical order); None: no unit uploads a design (the leaves are zero)."""
        order = canonical_order(keys["mean"])
        j = probe_unit(keys["interval"]["n"][order])
        return None if j is None else int(order[j])

    def server_update_sums(self, server: Tree, sums: Tree, count: Tensor) -> Tree:
        """``server_update`` from Σ_i reply_i (``sums``, no clients axis) and N (``count``).

        The sums as a cohort of one, so that the M-step is the same code; N replaces the
        cohort's size (the only place the M-step counts units).
        """
        one = {k: _one(v) for k, v in sums.items()}
        return self.server_update(server, one, torch.ones(1, dtype=torch.float64), units=count)


def _one(v):
    return {k: _one(u) for k, u in v.items()} if isinstance(v, dict) else v.unsqueeze(0)
