"""The direction term's coordinates the fleet's data do not identify (issue 20).

With ``branch_orders`` (the sweep direction's term b·ψ(x)ᵀh, module doc of
:mod:`fedcal.algorithms.fedprior`), a ψ coordinate that no unit's rows tell apart from the
rest of the design — no row has a direction, or every unit swept one way — is out of the
model: J is read from the summed support of the whole design (:meth:`BranchPins.unidentified`),
μ_J = 0 and Σ_JJ = ``floor`` (:meth:`BranchPins.pin`), the M-step runs on the other
coordinates (:meth:`BranchPins.pinned_update`) and the EM starts again from the vague start
when J changes and its columns held data (:meth:`BranchPins.restart`).

:class:`BranchPins` is a part of :class:`~fedcal.algorithms.fedprior.FedPrior` (its
``branch_pins``), declared by φ's number of terms, the design's number of features,
``min_informed``, ``floor`` and the vague start (``init_scale``, ``init_noise``); the M-step
on the kept coordinates is FedPrior's, passed in (``update``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from fedcal.core.bayes import F64
from fedcal.core.tree import Tree

# ψ coordinate j is unidentified when more than this share of e_j lies in the weak subspace
BRANCH_UNIDENTIFIED = 0.25


@dataclass(frozen=True)
class BranchPins:
    """The pinned ψ coordinates J: which, their values, the M-step without them (module doc)."""

    phi_terms: int  # φ's terms: ψ's coordinates start here
    features: int  # the design's columns [φ, b·ψ]
    min_informed: float  # a direction informed by fewer units is weak
    floor: float  # Σ_JJ = floor I
    init_scale: float  # the vague start's coefficient std
    init_noise: float  # the vague start's noise std

    def unidentified(self, support: Tensor | None) -> Tensor:
        """J (features,) bool: the direction term's ψ coordinates that the fleet's data do not
        tell apart from the rest of the design (issue 20), from the whole design's support.

        ψ coordinate j is unidentified when the weak subspace W of the summed support
        (directions fewer than ``min_informed`` units determine; module doc,
        "Identification") holds more than :data:`BRANCH_UNIDENTIFIED` of its unit vector,
        ‖P_W e_j‖² > 1/4: no row has a direction (b = 0: ‖P_W e_j‖² = 1) or every unit swept
        one way, so its rows see c + h along ψ only (‖P_W e_j‖² = 1/2, φ ⊇ ψ). ``support``
        is the summed ``branch_support`` upload, the support of the whole design [φ, b·ψ]
        whatever J and the basis chosen (in a sub-basis without φ's ψ terms, b·ψ of one-way
        units would pass for those terms; and J's own columns are masked out of the E-step).
        """
        pinned = torch.zeros(self.features, dtype=torch.bool)
        if support is None:  # no direction term
            return pinned
        vals, vecs = torch.linalg.eigh(0.5 * (support + support.T))
        weak = vecs[self.phi_terms :, vals < self.min_informed]
        pinned[self.phi_terms :] = (weak**2).sum(1) > BRANCH_UNIDENTIFIED
        return pinned

    def pinned_update(
        self,
        update: Callable[..., tuple[Tensor, Tensor, Tensor]],
        old_mu: Tensor,
        total: dict,
        count: Tensor,
        metric: Tensor,
        old_noise: Tensor,
        pinned: Tensor,
    ):
        """The M-step with the ψ coordinates J out of the model: the step on the other
        coordinates K alone (their blocks of every sum; the units' posteriors already have
        h_J ≈ 0), then μ_J = 0, Σ_J· = Σ_·J = 0, Σ_JJ = ``floor`` I, so every unit's
        posterior keeps h_J ≈ 0 and c takes all of c + h (:meth:`pin`).

        The weak directions among K come from the support's K block: a unit whose points
        saw c_j + h_j counts at least half along c_j there (a conservative count). Without
        this, a unit swept one way split c + h by the vague start and predicted the branch
        average of a term no unit identifies (issue 20: 230–240 hPa on all-few fleets)."""
        full = pinned.shape[0]
        keep = torch.nonzero(~pinned)[:, 0]

        def block(v: Tensor) -> Tensor:
            if v.dim() >= 1 and v.shape[-1] == full:
                v = v[..., keep]
            if v.dim() >= 2 and v.shape[-2] == full:
                v = v[..., keep, :]
            return v

        sub = {k: block(v) for k, v in total.items()}
        mu_k, sigma_k, noise_var = update(old_mu[keep], sub, count, block(metric), old_noise)
        mu = torch.zeros(full, dtype=F64)
        mu[keep] = mu_k
        sigma = torch.zeros(full, full, dtype=F64)
        sigma[keep.unsqueeze(1), keep.unsqueeze(0)] = sigma_k
        return (*self.pin(mu, sigma, pinned), noise_var)

    def pin(self, mu: Tensor, sigma: Tensor, pinned: Tensor) -> tuple[Tensor, Tensor]:
        """μ_J = 0, Σ_J· = Σ_·J = 0, Σ_JJ = ``floor`` I: h_J ≈ 0 in every posterior."""
        mu, sigma = mu.clone(), sigma.clone()
        mu[pinned] = 0.0
        sigma[pinned] = 0.0
        sigma[:, pinned] = 0.0
        j = torch.nonzero(pinned)[:, 0]
        sigma[j, j] = self.floor
        return mu, sigma

    def restart(
        self, server: Tree, pinned: Tensor, gram: Tensor
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        """The vague start with J pinned when J changed this round and its columns held data
        (the summed Gram ``gram``), else None.

        The EM so far ran on a model whose unidentified term split c + h by the start; its
        estimates along c carry that split, so the EM starts again on the model without J
        (from then on, round for round, the EM of the model without the term: one round
        later). Columns without data (b = 0 everywhere) split nothing: no restart."""
        if "pinned" not in server or torch.equal(server["pinned"] > 0, pinned):
            return None
        if not bool(torch.any(gram[pinned] != 0)):
            return None
        p = pinned.shape[0]
        start = self.pin(
            torch.zeros(p, dtype=F64), self.init_scale**2 * torch.eye(p, dtype=F64), pinned
        )
        return (*start, torch.tensor(self.init_noise**2, dtype=F64))
