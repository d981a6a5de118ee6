"""Client-level DP of the fleet prior's uploads: each statistic's public map and bound.

:class:`PrivateStatistics` is a part of :class:`~fedcal.algorithms.fedprior.FedPrior` (its
``private_statistics``), declared by what the bounds read: the number of features p, the rows
a unit may hold (``dp_max_rows``), the vague start (``init_scale``, ``init_noise``), whether
the moments are whitened by the broadcast Σ (``dp_whiten``), the second moment's weight, whether
the design has a direction term, and the selection part (the marginal scores' statistic).
``FedPrior.dp_statistics`` (the contract's hook, :mod:`fedcal.core.stages`) refuses the settings
DP does not cover and calls :meth:`PrivateStatistics.statistics`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedcal.algorithms.fedprior_select import EvidenceSelection
from fedcal.core.bayes import F64, safe_cholesky
from fedcal.core.privacy import Statistic
from fedcal.core.tree import Tree


@dataclass(frozen=True)
class PrivateStatistics:
    """The DP maps and bounds of one round's uploads (module doc).

    Maps come from the broadcast only (Σ = L Lᵀ, μ, σ²) and the vague start s
    (``init_scale``). The GLS terms in the prior's whitened coordinates are
    bounded by construction: Lᵀ gls_gram_i L = A_i⁻¹B_i has eigenvalues in [0, 1)
    and Lᵀ gls_rhs_i = z̄_i = L⁻¹(m_i − μ), bounded by 2√p (twice a prior draw's
    typical norm). The posterior mean and second moment are taken about μ in the
    units of the vague start, with ‖m_i − μ‖ ≤ 2√p s and
    ‖E[(c_i − μ)(c_i − μ)ᵀ]‖_F ≤ (2√p s)² + p s²; with ``dp_whiten`` in the broadcast
    prior's units instead, L⁻¹(m_i − μ), bounded by 2√p and (2√p)² + p (measured,
    studies/dp_scale.py: with adapted bounds the fleet's spread is resolved down to
    a smaller scale; with the declared worst-case bounds whitening feeds the noise back
    round after round). The GLS Gram and the support are declared about I (their
    value for a unit whose points determine every direction, most of a large fleet:
    small deviations, so small adapted bounds). Second-moment eigenvalues the noise
    hides take the smaller of the noise floor (what the fleet's spread is at most)
    and the vague start s² (whitened: the floor), and the support's are not
    counted, so the server keeps μ and s² there (its weak-direction rule).
    rss_i/σ² ≈ n_i ≤ ``dp_max_rows`` (bound 1.5×, by the broadcast σ²: a fixed
    scale would drown the RSS of good units in noise), and the noisy Σ rss at most
    the vague start's noise variance × Σ n (σ² never vaguer than the start) and at
    least 10⁻⁸ of it (σ ≥ 10⁻⁴ of the start: without this floor, noise draws that
    sent σ² toward 0 made new units' posterior Cholesky fail at ε = 1); with
    Legendre terms of inputs in [−1, 1], ‖Φ_iᵀΦ_i‖_F ≤ n_i p; the support's
    eigenvalues lie in [0, 1).
    """

    features: int  # p: columns of the design [φ, b·ψ]
    max_rows: float  # rows a unit may hold (public; the campaign)
    init_scale: float  # s: the vague start's coefficient std
    init_noise: float  # the vague start's noise std
    whiten: bool  # the moments in the broadcast prior's units (else the vague start's)
    second_weight: float  # the second moment's weight in the joint sensitivity
    branch: bool  # the design has a direction term (its support is uploaded)
    selection: EvidenceSelection  # select_by = "marginal": the scores' statistic
    weighted: bool  # the noise model weights rows (fedprior_noise): not covered
    interval: str  # "posterior" or "calibrated" (the hold-out uploads inputs: not covered)
    accelerate: str  # "off", or SQUAREM's per-unit log-evidence (not declared: not covered)

    def refusal(self) -> str | None:
        """Why client-level DP does not cover these settings (one line), or None."""
        if self.weighted:
            return (
                "fedprior: client-level DP covers noise_shape = 'constant' and noise_tail = "
                "'gaussian' only (the noise model's sums and row weights are not bounded)"
            )
        if self.interval != "posterior":
            return (
                "fedprior: client-level DP covers interval = 'posterior' only (the hold-out "
                "uploads a unit's inputs)"
            )
        if self.accelerate != "off":  # ℓ_i (fedprior_accel): no declared bound
            return (
                "fedprior: client-level DP covers accelerate = 'off' only (SQUAREM's "
                "per-unit log-evidence is not a declared statistic)"
            )
        if self.selection.each_candidate:
            # Every candidate's statistics would need their own noise (20× the sensitivity).
            return (
                "fedprior: client-level DP with select = 'bic' needs select_by = 'marginal' "
                "(one bounded score vector per unit), or select = 'none' (fedprior_fixed)"
            )
        return None

    def checked(self, down: Tree) -> dict[str, Statistic]:
        """:meth:`statistics`, or a ValueError for the settings DP does not cover
        (:meth:`refusal`): FedPrior's ``dp_statistics`` hook (core/hooks.py)."""
        why = self.refusal()
        if why is not None:
            raise ValueError(why)
        return self.statistics(down)

    def statistics(self, down: Tree) -> dict[str, Statistic]:
        """Client-level DP: each uploaded statistic's public map and bound (core/privacy; the
        bounds: class doc)."""
        p = self.features
        chol = safe_cholesky(down["sigma"].to(F64))[0]
        mu, rows, s = down["mu"].to(F64), float(self.max_rows), self.init_scale
        z = 2.0 * p**0.5
        second = (z * s) ** 2 + p * s * s
        noise_var = down["noise_var"].to(F64)
        # gls_gram and support are taken about their value for a unit whose points determine
        # every direction (Lᵀ gls_gram L → I, support → I): most of a large fleet's units,
        # whose deviation is small, so an adapted bound (core.privacy.AdaptiveClip) is too.
        eye = torch.eye(p, dtype=F64)
        sigma_inv = torch.cholesky_inverse(chol)
        moment_map = None
        if self.whiten:  # z = L⁻¹(m − μ): the broadcast prior's units, not the vague start's
            moment_map = torch.linalg.solve_triangular(chol, eye, upper=False)
            second = z**2 + p
            s = 1.0
        out = {
            "mean": Statistic(z * s, "vector", moment_map, center=mu),
            "second": Statistic(
                second,
                "second_moment",
                moment_map,
                center=mu,
                first="mean",
                noise_floor=True,
                maximum=second,
                unresolved=None if self.whiten else s * s,
                weight=self.second_weight,
            ),
            "gls_gram": Statistic(
                p**0.5, "psd", chol.T, center=sigma_inv, maximum=1.0, noise_floor=True
            ),
            "gls_rhs": Statistic(z, "vector", chol.T),
            "rss": Statistic(
                1.5 * rows,
                "positive",
                1.0 / noise_var,
                minimum=1.0,
                ratio=(
                    "n",
                    (1e-4 * self.init_noise) ** 2 / noise_var,
                    self.init_noise**2 / noise_var,
                ),
            ),
            "n": Statistic(rows, "positive", minimum=1.0, maximum=rows),
            "gram": Statistic(rows * p, "psd", minimum=1e-9 * rows, noise_floor=True),
            "support": Statistic(
                p**0.5, "psd", center=eye, maximum=1.0, noise_floor=True, unresolved=0.0
            ),
            **(
                {
                    "branch_support": Statistic(
                        p**0.5, "psd", center=eye, maximum=1.0, noise_floor=True, unresolved=0.0
                    )
                }
                if self.branch
                else {}
            ),
        }
        if self.selection.select != "none":  # select_by = "marginal": the candidates' scores
            out["select"] = self.selection.dp_select_statistic(out)
        return out
