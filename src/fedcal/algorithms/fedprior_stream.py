"""fedprior's server update from the replies' sums (issue 25.1; :mod:`fedcal.engine.streamed`).

fedprior's M-step (module doc of :mod:`fedcal.algorithms.fedprior`, step 2) reads its
replies only as sums over the units — Σ m_i, Σ (m_i m_iᵀ + V_i), the GLS terms, Σ RSS, Σ n,
the Gram and support sums, every candidate's — and the unit count N. ``robust = "full"``
weights each unit by its leave-one-out distance (:mod:`fedcal.algorithms.fedprior_robust`),
from its m_i and S_i: a streamed round keeps those per unit (:attr:`outlier_inputs`) and
corrects the sums by Σ (w_i − 1)·reply_i. Two settings read more of each unit's reply and
are refused for streaming: ``interval = "calibrated"`` (the hold-out's per-unit probes) and
a subclass with its own ``server_update`` (fedprior_drift).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fedcal.core.tree import Tree


class StreamedSums:
    """:meth:`server_update_sums` and when it is refused; a mixin of ``FedPrior``."""

    def streaming_refused(self) -> str | None:
        """None when :meth:`server_update_sums` equals ``server_update``; else why not."""
        # the server update in use must be the one of the class that mixes these sums in
        owner = next(c for c in type(self).__mro__ if "server_update" in vars(c))
        if StreamedSums not in owner.__bases__:
            return f"{self.name}: its server update is its own (per-unit replies)"
        if self.interval == "calibrated":
            return f"{self.name}: interval = 'calibrated' reads each unit's hold-out probes"
        if self.noise_shape != "constant" or self.noise_tail != "gaussian":
            return f"{self.name}: the noise model's evidence is clipped unit by unit"
        return None

    @property
    def outlier_inputs(self) -> tuple[str, ...]:
        """The reply leaves :meth:`outlier_weights` reads per unit (m_i, S_i): kept per unit
        by a streamed round when ``robust = "full"``, (p + p²) numbers a unit."""
        return ("mean", "second") if self.robust == "full" else ()

    def server_update_sums(self, server: Tree, sums: Tree, count: Tensor) -> Tree:
        """``server_update`` from Σ_i reply_i (``sums``, no clients axis) and N (``count``).

        The sums as a cohort of one, so that the M-step is the same code; N replaces the
        cohort's size (the only place the M-step counts units).
        """
        one = {k: _one(v) for k, v in sums.items()}
        return self.server_update(server, one, torch.ones(1, dtype=torch.float64), units=count)


def _one(v):
    return {k: _one(u) for k, u in v.items()} if isinstance(v, dict) else v.unsqueeze(0)
