"""The walk of a unit's coefficients in time: its whitened moments, its future scores and its
variance in use (:class:`~fedcal.algorithms.fedprior_drift.FedPriorDrift`'s steps W1–W3; ours).

The model (fedprior_drift's module doc): c_i(t) = c_i(t_i) + w_i(t), Cov(w_i(t), w_i(t')) =
q · min(t_i − t, t_i − t') · Σ_d / T before t_i, with Σ_d = Π Σ Π (:meth:`DriftWalk.drift_cov`)
the fleet prior Σ on the basis in use and on the directions the fleet's data identify.

W1. **Whitened moments** (the Kalman smoother's answer, in closed form). A unit's rows are
    grouped into B = ``drift_bins`` (0: 240 // p, between 4 and 32) equal bins of its own
    calibration span; within a bin the walk is held at the bin's mean time τ_b (time before
    t_i, in units of T). Stacking the bins' walks, w ~ N(0, P), P = q · (T_min ⊗ Σ_d),
    T_min[b, b'] = min(τ_b, τ_b'), and Z the map of each row to its bin's block (row r in
    bin b reads φ_rᵀ w_b), the rows are

        y = Φ c_i(t_i) + e,   e ~ N(0, σ² R̄),   R̄ = I + Z P Zᵀ / σ².

    Every statistic of :mod:`fedcal.core.bayes` then holds for c_i(t_i) with the *whitened
    moments* G̃ = ΦᵀR̄⁻¹Φ, b̃ = ΦᵀR̄⁻¹y, ỹy = yᵀR̄⁻¹y (n unchanged) in place of ΦᵀΦ, Φᵀy, yᵀy,
    and the log-evidence gains −½ log|R̄|. With P = q L Lᵀ, L = chol(T_min) ⊗ chol(Σ_d), the
    eigen-decomposition F = Lᵀ blockdiag(G_b) L = E Λ Eᵀ (G_b, h_b: bin b's Gram and Φᵀy) and
    U = Eᵀ Lᵀ [G_1; …; G_B], u = Eᵀ Lᵀ [h_1; …; h_B], Woodbury gives for every q at once

        G̃ = G − q Uᵀ D U,   b̃ = b − q Uᵀ D u,   ỹy = yy − q uᵀ D u,
        D = diag(1/(σ² + qλ)),   log|R̄| = Σ log(1 + qλ/σ²)

    (:meth:`DriftWalk.parts`, what every q shares; :meth:`DriftWalk.whiten`, each q). Older
    rows are correlated with each other through the walk, so they count less: the posterior
    weighs recent points more.
W2. **Scores per q** of :data:`DRIFT_GRID`, under the broadcast prior: the in-sample
    log-evidence (:meth:`DriftWalk.grid_posterior`) and the unit's held-out future
    (:meth:`DriftWalk.future_scores`): the last ``drift_holdout`` (25 %) of its calibration
    span held out, the posterior at the latest earlier row t_p, from the earlier rows
    whitened by q_k, predicts each held-out row as the unit would in use,
    N(φᵀm, σ² + φᵀVφ + (q_k/T)(t − t_p)φᵀΣ_dφ), and the score is the sum of the held-out
    rows' log densities.
W3. **Use.** The predictive variance at time t adds the walk since t_i,
    (q/T) · max(t − t_i, 0) · φ(x)ᵀ Σ_d φ(x) (:meth:`DriftWalk.var`; φ the guarded basis
    beyond the support box).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from fedcal.algorithms.fedprior_basis import DesignBasis, unit_noise
from fedcal.algorithms.fedprior_short import unit_span, unit_times
from fedcal.algorithms.fedprior_support import SupportBox
from fedcal.core.bayes import F64, Moments, moments, posterior, safe_cholesky
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree

# q per fleet time scale T, in units of Σ: 0, then 8 per decade from 1e-3 to 10 (steps of 33 %).
DRIFT_GRID = torch.cat([torch.zeros(1, dtype=F64), torch.logspace(-3, 1, 33, dtype=F64)])
BIN_SIZE = 240  # auto bins: B = clamp(BIN_SIZE // features, 4, 32) (the eigenproblem is B·p)


@dataclass(frozen=True)
class DriftWalk:
    """Steps W1–W3 (module doc); a part of
    :class:`~fedcal.algorithms.fedprior_drift.FedPriorDrift` (its ``walk``), declared by the
    settings it reads (``drift_bins``, ``drift_holdout``, ``noise``), the basis's size, the
    design basis and the support box (φ guarded beyond it)."""

    bins: int  # drift_bins: B; 0, as many as the basis affords (BIN_SIZE)
    holdout: float  # drift_holdout: the share of a unit's span held out as its future (W2)
    noise: str  # "fleet" or "sensor" (fedprior_basis.unit_noise)
    features: int  # the design's columns, [φ, b·ψ]
    phi_terms: int  # φ's terms: the coordinates that drift
    basis: DesignBasis
    support_box: SupportBox

    def drift_map(self, down: Tree) -> Tensor:
        """(…, features, features): the map onto the coordinates that drift — φ's terms of
        the basis in use, on the directions the fleet's data identify (``seen``: along a
        weakly identified direction Σ is the vague start's, not a spread to drift along)."""
        m = torch.zeros(self.features, dtype=F64)
        m[: self.phi_terms] = 1.0
        if "mask" in down:
            m = m * down["mask"].to(F64).reshape(-1, self.features)[0]
        seen = down["drift"].get("seen")
        seen = torch.eye(len(m), dtype=F64) if seen is None else seen.to(F64)
        return m.unsqueeze(-1) * seen

    def drift_cov(self, down: Tree) -> Tensor:
        """Σ_d (clients, features, features): the broadcast Σ on the drifting coordinates."""
        a = self.drift_map(down)
        return a @ down["sigma"].to(F64) @ a.transpose(-2, -1)

    def parts(self, down: Tree, data: ClientData, mask: Tensor | None = None) -> Tree:
        """W1, what every q shares: static moments, the eigenpairs of F, U and u (module
        doc); on the rows of ``mask`` (default: all real rows), anchored at their latest
        time."""
        t = unit_times(data)
        mask = data.mask.to(F64) if mask is None else mask.to(F64)
        design = self.basis.design(data.x, data.branch)
        full = moments(design, data.y[..., 0], mask)
        c, _, p = design.shape
        nb = self.bins or min(32, max(4, BIN_SIZE // p))
        scale = down["drift"]["scale"].to(F64).reshape(-1)[0]
        t_ref, span = unit_span(t, mask)
        tau = torch.where(mask > 0, (t_ref.unsqueeze(1) - t) / scale, 0.0)  # before t_i, in T
        width = (span / scale / nb).unsqueeze(1)  # bin width (clients, 1)
        k = torch.where(width > 0, torch.floor(tau / width.clamp_min(1e-300)), 0.0)
        onehot = torch.nn.functional.one_hot(k.clamp(0, nb - 1).long(), nb).to(F64)
        onehot = onehot * mask.unsqueeze(-1)  # (c, rows, B)
        count = onehot.sum(1)
        centre = (torch.arange(nb, dtype=F64) + 0.5) * width
        tau_b = torch.where(
            count > 0, (onehot * tau.unsqueeze(-1)).sum(1) / count.clamp_min(1), centre
        )
        # Strictly increasing and positive, so T_min is positive definite (a unit of one time
        # has a vanishing walk: its moments stay fedprior's).
        tau_b = tau_b.clamp_min(0.0) + 1e-9 * (torch.arange(nb, dtype=F64) + 1)
        t_min = torch.minimum(tau_b.unsqueeze(-1), tau_b.unsqueeze(-2))
        l_t = safe_cholesky(t_min)[0]  # (c, B, B)
        l_s = (self.drift_map(down) @ safe_cholesky(down["sigma"].to(F64))[0]).expand(c, p, p)
        wd = design * mask.unsqueeze(-1)
        g_b = torch.einsum("crb,cri,crj->cbij", onehot, wd, wd)  # bins' Grams (c, B, p, p)
        h_b = torch.einsum("crb,cri,cr->cbi", onehot, wd, data.y[..., 0].to(F64) * mask)
        # L = chol(T_min) ⊗ chol(Σ_d), never formed: F[(a,i),(a',j)] = Σ_b L_t[b,a] L_t[b,a']
        # (L_sᵀ G_b L_s)[i,j], and Lᵀ stacks Σ_b L_t[b,a] L_sᵀ(·)_b.
        ls_g = l_s.transpose(1, 2).unsqueeze(1) @ g_b  # L_sᵀ G_b (c, B, p, p)
        f = torch.einsum("cba,cbd,cbij->caidj", l_t, l_t, ls_g @ l_s.unsqueeze(1))
        f = f.reshape(c, nb * p, nb * p)
        lam, vec = torch.linalg.eigh(0.5 * (f + f.transpose(1, 2)))
        lam = lam.clamp_min(0.0)
        lt_g = torch.einsum("cba,cbij->caij", l_t, ls_g).reshape(c, nb * p, p)  # Lᵀ [G_b]
        lt_h = torch.einsum(
            "cba,cbi->cai", l_t, (l_s.transpose(1, 2).unsqueeze(1) @ h_b.unsqueeze(-1))[..., 0]
        )
        vt = vec.transpose(1, 2)  # Eᵀ
        return {
            "moments": full,
            "lam": lam,
            "u_mat": vt @ lt_g,
            "u_vec": (vt @ lt_h.reshape(c, nb * p, 1))[..., 0],
            "span": span,
        }

    @staticmethod
    def whiten(parts: Tree, q: Tensor, noise: Tensor) -> tuple[Moments, Tensor]:
        """W1, the whitened moments and log|R̄| for drift variances ``q`` (clients, K):
        Moments of shape (clients, K, …) and (clients, K)."""
        full, lam = parts["moments"], parts["lam"]
        s2 = noise.to(F64).reshape(-1, 1, 1)  # (c, 1, 1)
        qq = q.unsqueeze(-1)  # (c, K, 1)
        d = qq / (s2 + qq * lam.unsqueeze(1))  # q/(σ² + qλ): (c, K, Bp)
        um, uv = parts["u_mat"].unsqueeze(1), parts["u_vec"].unsqueeze(1)
        gram = full.gram.unsqueeze(1) - (um * d.unsqueeze(-1)).transpose(-2, -1) @ um
        gram = 0.5 * (gram + gram.transpose(-2, -1))
        rhs = full.rhs.unsqueeze(1) - ((um * d.unsqueeze(-1)) * uv.unsqueeze(-1)).sum(-2)
        yy = full.yy.unsqueeze(1) - (d * uv * uv).sum(-1)
        n = full.n.unsqueeze(1).expand_as(yy)
        logdet = torch.log1p(qq * lam.unsqueeze(1) / s2).sum(-1)
        return Moments(gram, rhs, yy.clamp_min(0.0), n), logdet

    def whitened(self, down: Tree, data: ClientData) -> Moments | None:
        """The unit's moments whitened by the broadcast drift q; None where they are the
        static ones (no drift known, no time column, or q = 0: exactly fedprior)."""
        if "drift" not in down or data.time is None:
            return None
        q = down["drift"]["q"].to(F64).reshape(-1)
        if not bool((q > 0).any()):
            return None
        parts = self.parts(down, data)
        w, _ = self.whiten(parts, q.unsqueeze(1), down["noise_var"].to(F64).reshape(-1))
        return Moments(*(v[:, 0] for v in w))

    def grid_posterior(self, down: Tree, noise: Tensor, parts: Tree) -> tuple[Tensor, Tensor]:
        """W2: (posterior per grid q (clients·K), −½ log|R̄| (clients, K)) under the broadcast
        prior, on the chosen basis (its unused terms see no data)."""
        c, k = parts["lam"].shape[0], len(DRIFT_GRID)
        w, logdet = self.whiten(parts, DRIFT_GRID.expand(c, -1), noise)
        flat = Moments(*(v.reshape(c * k, *v.shape[2:]) for v in w))
        if "mask" in down:
            mm = down["mask"].to(F64).repeat_interleave(k, 0)
            flat = Moments(
                flat.gram * mm.unsqueeze(-1) * mm.unsqueeze(-2), flat.rhs * mm, flat.yy, flat.n
            )
        post = posterior(
            flat,
            down["mu"].to(F64).repeat_interleave(k, 0),
            down["sigma"].to(F64).repeat_interleave(k, 0),
            noise.repeat_interleave(k, 0),
        )
        return post, -0.5 * logdet

    def future_scores(self, down: Tree, state: Tree, data: ClientData) -> Tensor:
        """W2, (clients, K): each unit's predictive log score of its own future, for every q_k.

        The last ``drift_holdout`` of the unit's calibration span is held out; its posterior
        at the latest earlier row t_p (whitened by q_k, under the broadcast prior) predicts
        each held-out row r by N(φ_rᵀm, σ² + φ_rᵀVφ_r + (q_k/T)(t_r − t_p) φ_rᵀΣ_dφ_r), the
        interval the unit would state at t_r (W3), and the score is Σ_r log N(y_r; …). A unit
        without both parts (a single time) scores 0 for every q.
        """
        c, k = data.num_clients, len(DRIFT_GRID)
        t, mask = unit_times(data), data.mask.to(F64)
        t_last, span = unit_span(t, mask)
        fut = ((mask > 0) & (t > (t_last - self.holdout * span).unsqueeze(1))).to(F64)
        past = mask - fut
        use = (past.sum(1) > 0) & (fut.sum(1) > 0) & (span > 0)
        if not bool(use.any()):
            return torch.zeros(c, k, dtype=F64)
        noise = unit_noise(self.noise, down, state).to(F64).reshape(-1)
        post, _ = self.grid_posterior(down, noise, self.parts(down, data, past))
        design = self.basis.design(data.x, data.branch).to(F64)
        if "mask" in down:  # the chosen basis's terms only
            design = design * down["mask"].to(F64).unsqueeze(1)
        p = design.shape[-1]
        mean, cov = post.mean.reshape(c, k, p), post.cov.reshape(c, k, p, p)
        pred = torch.einsum("crp,ckp->ckr", design, mean)
        spread_v = ((design.unsqueeze(1) @ cov) * design.unsqueeze(1)).sum(-1)  # φᵀVφ (c,K,r)
        t_past, _ = unit_span(t, past)
        scale = down["drift"]["scale"].to(F64).reshape(-1)[0]
        dt = (t - t_past.unsqueeze(1)).clamp_min(0.0) / scale
        walk = ((design @ self.drift_cov(down)) * design).sum(-1) * dt  # (c, r)
        var = noise.reshape(-1, 1, 1) + spread_v + DRIFT_GRID.reshape(1, -1, 1) * walk.unsqueeze(1)
        resid = data.y[..., 0].to(F64).unsqueeze(1) - pred
        logp = -0.5 * (torch.log(2 * math.pi * var) + resid**2 / var)
        score = (logp * fut.unsqueeze(1)).sum(-1)
        return torch.where(use.unsqueeze(1), score, 0.0)

    def var(self, params: Tree, x: Tensor, time: Tensor) -> Tensor:
        """W3: (q/T) · max(t − t_i, 0) · φ(x)ᵀ Σ_d φ(x) per row (clients, rows)."""
        p = self.phi_terms
        phi, _ = self.support_box.guarded(params, x.to(F64))
        cov = params["drift_cov"].to(F64)[..., :p, :p]
        spread = ((phi @ cov) * phi).sum(-1)
        dt = (time.to(F64) - params["t_ref"].to(F64).unsqueeze(1)).clamp_min(0.0)
        return params["drift_rate"].to(F64).unsqueeze(1) * dt * spread
