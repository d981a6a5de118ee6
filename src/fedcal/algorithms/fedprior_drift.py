"""The fleet prior with drift: each unit's coefficients walk between calibration and use (ours).

Field units drift (a gain that ages, a metal-oxide baseline that wanders over months), so
the coefficients a co-location determined are not those of the period they are used in.
Each unit's coefficients follow a random walk in time, anchored at its latest calibration
point t_i (:class:`~fedcal.algorithms.fedprior.FedPrior`'s prior holds there):

    y_ir = φ(x_ir)ᵀ c_i(t_ir) + ε_ir,    ε ~ N(0, σ²),
    c_i(t_i) ~ N(μ, Σ),                  c_i(t) = c_i(t_i) + w_i(t),
    Cov(w_i(t), w_i(t')) = q · min(t_i − t, t_i − t') · Σ_d / T       (t, t' ≤ t_i),
    c_i(t) for t > t_i:   Var c_i(t) = V_i + q · (t − t_i) · Σ_d / T,

with Σ_d = Π Σ Π the fleet prior Σ on the basis in use, Π the projection onto the directions
the fleet's data identify (fedprior's identification rule; along a weakly identified
direction Σ is the vague start, not a spread to drift along): the drift moves a unit along
the directions the fleet's units differ in, T the fleet's time scale (the mean of the units'
calibration spans, from the sums the server adds) and q ≥ 0 one dimensionless drift variance:
over one mean calibration span a unit drifts by q times the fleet's spread. q is learned by the
federation from every unit's time-stamped rows.

E-step (the Kalman smoother's answer, in closed form). A unit's rows are grouped into
B = ``drift_bins`` (0: 240 // p, between 4 and 32) equal bins of its own calibration span;
within a bin the walk is held at the bin's mean time τ_b (time before t_i, in units of T).
Stacking the bins' walks, w ~ N(0, P), P = q · (T_min ⊗ Σ_d), T_min[b, b'] = min(τ_b, τ_b'),
and Z the map of each row to its bin's block (row r in bin b reads φ_rᵀ w_b), the rows are

    y = Φ c_i(t_i) + e,   e ~ N(0, σ² R̄),   R̄ = I + Z P Zᵀ / σ².

Every statistic of :mod:`fedcal.core.bayes` then holds for c_i(t_i) with the *whitened
moments* G̃ = ΦᵀR̄⁻¹Φ, b̃ = ΦᵀR̄⁻¹y, ỹy = yᵀR̄⁻¹y (n unchanged) in place of ΦᵀΦ, Φᵀy, yᵀy,
and the log-evidence gains −½ log|R̄|. With P = q L Lᵀ, L = chol(T_min) ⊗ chol(Σ_d), the
eigen-decomposition F = Lᵀ blockdiag(G_b) L = E Λ Eᵀ (G_b, h_b: bin b's Gram and Φᵀy) and
U = Eᵀ Lᵀ [G_1; …; G_B], u = Eᵀ Lᵀ [h_1; …; h_B], Woodbury gives for every q at once

    G̃ = G − q Uᵀ D U,   b̃ = b − q Uᵀ D u,   ỹy = yy − q uᵀ D u,
    D = diag(1/(σ² + qλ)),   log|R̄| = Σ log(1 + qλ/σ²).

Older rows are correlated with each other through the walk, so they count less: the
posterior weighs recent points more. :meth:`_client_moments` hands these moments to
fedprior's E-step, M-step, selection and intervals unchanged.

Learning q (ECM). Each round every unit also uploads its log-evidence
log p(y_i | μ, Σ, σ², q_k) for each q_k of :data:`DRIFT_GRID` (and its span); the server
adds them and keeps the q_k of highest fleet evidence, or q = 0 unless that beats q = 0 by
a likelihood-ratio test (2Δ log p > ``drift_test``, 3.84: χ²₁ at 5 %). The next round's
E-step uses it. The σ² step treats R̄ as fixed at the broadcast σ² (a fixed-point step).
Round 0 has no time scale yet and runs with q = 0.

Use. The prediction is φ(x)ᵀm_i (a random walk has no expected direction); the predictive
variance at time t adds the walk since t_i,

    Var = [fedprior's variance] + (q/T) · max(t − t_i, 0) · φ(x)ᵀ Σ_d φ(x),

(:meth:`predictive_std_timed`; φ is the guarded basis beyond the support box). The unit's
``recalibrate_at`` (per_sensor.csv) is when the mean predictive variance over its own
calibration inputs, v̄(t) = v̄₀ + d̄ (t − t_i), reaches ``recalibrate_ratio``² times v̄₀,
i.e. its σ has grown by that factor: t_i + (ratio² − 1) v̄₀ / d̄ (empty when q = 0: never).

Reduction: with q = 0 (planted or learned) every moment is fedprior's exactly, and so are
the predictions and intervals. Without a time column (e.g. chamber data) no unit has a span, q stays 0 and the run is fedprior's;
``prior.json`` says so (``drift.note``).
Simplifications: the noise level in R̄ is the fleet's (also with ``noise = "sensor"``); the
hold-out of calibrated intervals (fedprior's I2) fits its probe rows without drift; the
firmware exports carry the variance at t_i (no drift term); client-level DP is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from fedcal.algorithms.fedprior import FedPrior
from fedcal.core.algorithm import ClientResult
from fedcal.core.bayes import F64, Moments, posterior, safe_cholesky
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree

# q per fleet time scale T, in units of Σ: 0, then 8 per decade from 1e-3 to 10 (steps of 33 %).
DRIFT_GRID = torch.cat([torch.zeros(1, dtype=F64), torch.logspace(-3, 1, 33, dtype=F64)])
BIN_SIZE = 240  # auto bins: B = clamp(BIN_SIZE // features, 4, 32) (the eigenproblem is B·p)
NO_TIME = "no time column: q = 0, fedprior's model (give the data --time-column for drift)"


@dataclass(frozen=True)
class FedPriorDrift(FedPrior):
    # B: bins of a unit's calibration span within which the walk is held; 0: as many as the
    # basis affords (BIN_SIZE). Measured on a planted fleet (1 input, 2 terms): 8 bins put
    # the within-bin drift into σ (0.060 for a planted 0.05) and 30 bins 0.055.
    drift_bins: Annotated[int, Field(ge=0)] = 0
    # 2Δ log-evidence a q > 0 must gain over q = 0 (χ²₁, 5 %)
    drift_test: Annotated[float, Field(ge=0.0)] = 3.84
    # recalibrate_at: when the unit's mean σ has grown by this factor
    recalibrate_ratio: Annotated[float, Field(gt=1.0)] = 2.0

    name = "fedprior_drift"
    # A unit's drift evidences grow with its rows, like its residual terms: not screened.
    unscreened_replies = (*FedPrior.unscreened_replies, "drift/")

    # ---- time ------------------------------------------------------------------------
    @staticmethod
    def _time(data: ClientData) -> Tensor:
        """Each row's time; without a time column every row at 0 (no span: q stays 0)."""
        if data.time is None:
            return torch.zeros(data.mask.shape, dtype=F64)
        return data.time.to(F64)

    @staticmethod
    def _span(t: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """(t_i, span_i): each unit's latest row time and its calibration span (clients,)."""
        real = mask > 0
        last = torch.where(real, t, -math.inf).amax(1)
        first = torch.where(real, t, math.inf).amin(1)
        ok = real.any(1)
        return torch.where(ok, last, 0.0), torch.where(ok, last - first, 0.0)

    def _drift_map(self, down: Tree) -> Tensor:
        """(…, features, features): the map onto the coordinates that drift — φ's terms of
        the basis in use, on the directions the fleet's data identify (``seen``: along a
        weakly identified direction Σ is the vague start's, not a spread to drift along)."""
        p = len(self.terms)
        m = torch.zeros(self.num_features, dtype=F64)
        m[:p] = 1.0
        if "mask" in down:
            m = m * down["mask"].to(F64).reshape(-1, self.num_features)[0]
        seen = down["drift"].get("seen")
        seen = torch.eye(len(m), dtype=F64) if seen is None else seen.to(F64)
        return m.unsqueeze(-1) * seen

    def _drift_cov(self, down: Tree) -> Tensor:
        """Σ_d (clients, features, features): the broadcast Σ on the drifting coordinates."""
        a = self._drift_map(down)
        return a @ down["sigma"].to(F64) @ a.transpose(-2, -1)

    # ---- the whitened moments (module doc, E-step) -------------------------------------
    def _drift_parts(self, down: Tree, data: ClientData) -> Tree:
        """What every q shares: static moments, the eigenpairs of F, U and u (module doc)."""
        t, mask = self._time(data), data.mask.to(F64)
        design = self.design(data.x, data.branch)
        full = self._moments(data)
        c, _, p = design.shape
        nb = self.drift_bins or min(32, max(4, BIN_SIZE // p))
        scale = down["drift"]["scale"].to(F64).reshape(-1)[0]
        t_ref, span = self._span(t, mask)
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
        l_s = (self._drift_map(down) @ safe_cholesky(down["sigma"].to(F64))[0]).expand(c, p, p)
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
    def _whiten(parts: Tree, q: Tensor, noise: Tensor) -> tuple[Moments, Tensor]:
        """The whitened moments and log|R̄| for drift variances ``q`` (clients, K):
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

    def _client_moments(self, down: Tree, data: ClientData) -> Moments:
        """fedprior's E-step moments: whitened by the broadcast drift q (static at q = 0)."""
        if "drift" not in down or data.time is None:  # no drift known, or no time column
            return self._moments(data)
        q = down["drift"]["q"].to(F64).reshape(-1)
        if not bool((q > 0).any()):
            return self._moments(data)  # q = 0: exactly fedprior
        parts = self._drift_parts(down, data)
        w, _ = self._whiten(parts, q.unsqueeze(1), down["noise_var"].to(F64).reshape(-1))
        return Moments(*(v[:, 0] for v in w))

    # ---- the contract -----------------------------------------------------------------
    def server_init(self, params: Tree) -> Tree:
        zero = torch.tensor(0.0, dtype=F64)
        drift = {
            "q": zero.clone(),
            "scale": zero.clone(),
            "seen": torch.eye(self.num_features, dtype=F64),
            "loglik": torch.zeros_like(DRIFT_GRID),
        }
        return {**super().server_init(params), "drift": drift}

    def broadcast(self, server: Tree) -> Tree:
        return {
            **super().broadcast(server),
            "drift": {k: server["drift"][k] for k in ("q", "scale", "seen")},
        }

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        t = self._time(data)
        result = super().client_update(down, state, data)
        c = data.num_clients
        _, span = self._span(t, data.mask.to(F64))
        loglik = torch.zeros(c, len(DRIFT_GRID), dtype=F64)
        if float(down["drift"]["scale"].reshape(-1)[0]) > 0:  # the fleet's time scale is known
            parts = self._drift_parts(down, data)
            noise = down["noise_var"].to(F64).reshape(-1)
            w, logdet = self._whiten(parts, DRIFT_GRID.expand(c, -1), noise)
            k = len(DRIFT_GRID)
            flat = Moments(*(v.reshape(c * k, *v.shape[2:]) for v in w))
            mu, sigma = down["mu"].to(F64), down["sigma"].to(F64)
            if "mask" in down:  # the chosen basis's evidence (its unused terms see no data)
                m = down["mask"].to(F64)
                mm = m.repeat_interleave(k, 0)
                flat = Moments(
                    flat.gram * mm.unsqueeze(-1) * mm.unsqueeze(-2), flat.rhs * mm, flat.yy, flat.n
                )
            post = posterior(
                flat,
                mu.repeat_interleave(k, 0),
                sigma.repeat_interleave(k, 0),
                noise.repeat_interleave(k, 0),
            )
            loglik = post.loglik.reshape(c, k) - 0.5 * logdet
        reply = {**result.reply, "drift": {"loglik": loglik, "span": span}}
        return ClientResult(reply, result.state, result.metrics)

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        drift = replies["drift"]
        stats = {k: v for k, v in replies.items() if k != "drift"}
        new = super().server_update(server, stats, weights)
        # The canonical order of fedprior's sums: the rounding cannot depend on arrival order.
        order = torch.from_numpy(np.lexsort(replies["mean"].numpy().T[::-1]).copy())
        count = float(replies["mean"].shape[0])
        loglik = drift["loglik"]
        robust = self.outlier_weights(server, stats)  # q's evidence weighted like the M-step's
        if robust is not None and bool((robust.weights != 1).any()):
            loglik = loglik * robust.weights.unsqueeze(1)
        loglik = loglik[order].sum(0)
        old = server["drift"]
        q = torch.tensor(0.0, dtype=F64)
        if float(old["scale"]) > 0:  # the grid was evaluated this round
            k = int(torch.argmax(loglik))  # ties: the smaller q
            if float(loglik[k] - loglik[0]) > 0.5 * self.drift_test:
                q = DRIFT_GRID[k].clone()
        scale = drift["span"][order].sum(0) / max(count, 1.0)
        if float(old["scale"]) > 0:
            scale = old["scale"].clone()  # the time scale is fixed once known
        new["drift"] = {"q": q, "scale": scale.to(F64), "seen": self._seen(new), "loglik": loglik}
        return new

    def _seen(self, server: Tree) -> Tensor:
        """The projection onto the directions of the basis in use that at least
        ``min_informed`` units' data determine (fedprior's identification rule)."""
        _, idx = self.chosen_features(server)
        support = server["support"][idx][:, idx]
        vals, vecs = torch.linalg.eigh(0.5 * (support + support.T))
        keep = vecs[:, vals >= self.min_informed]
        seen = torch.zeros(self.num_features, self.num_features, dtype=F64)
        seen[idx.unsqueeze(1), idx.unsqueeze(0)] = keep @ keep.T
        return seen

    def personal_shapes(self) -> dict[str, tuple[int, ...]]:
        p = self.num_features
        return {**super().personal_shapes(), "t_ref": (), "drift_rate": (), "drift_cov": (p, p)}

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        out = super().personalize(down, state, data)
        if "drift" not in down:  # a prior without drift (e.g. read back from prior.json)
            return out
        t_ref, _ = self._span(self._time(data), data.mask.to(F64))
        q, scale = down["drift"]["q"].to(F64), down["drift"]["scale"].to(F64)
        rate = torch.where(scale > 0, q / scale.clamp_min(1e-300), 0.0).reshape(-1)
        out.update(t_ref=t_ref, drift_rate=rate.expand_as(t_ref), drift_cov=self._drift_cov(down))
        return out

    def _gram_counts_rows(self, server: Tree) -> bool:
        # With q > 0 the E-step's Gram is whitened, G̃ = ΦᵀR̄⁻¹Φ: its constant term 1ᵀR̄⁻¹1 is
        # below n (still PSD, and the GLS identities still hold, so those are checked).
        return not float(server["drift"]["q"]) > 0

    def dp_statistics(self, down: Tree):
        raise ValueError("fedprior_drift: client-level DP is not covered (use fedprior)")

    # ---- use ---------------------------------------------------------------------------
    def _drift_var(self, params: Tree, x: Tensor, time: Tensor) -> Tensor:
        """(q/T) · max(t − t_i, 0) · φ(x)ᵀ Σ_d φ(x) per row (clients, rows)."""
        p = len(self.terms)
        phi, _ = self._guarded(params, x.to(F64), self.terms)
        cov = params["drift_cov"].to(F64)[..., :p, :p]
        spread = ((phi @ cov) * phi).sum(-1)
        dt = (time.to(F64) - params["t_ref"].to(F64).unsqueeze(1)).clamp_min(0.0)
        return params["drift_rate"].to(F64).unsqueeze(1) * dt * spread

    def predictive_std_timed(self, params: Tree, data: ClientData) -> Tensor:
        """:meth:`predictive_std` at each row's time: + the walk since t_i (module doc)."""
        std = self.predictive_std(params, data.x)
        if data.time is None or "drift_rate" not in params:
            return std
        var = std.to(F64)[..., 0] ** 2 + self._drift_var(params, data.x, data.time)
        return var.sqrt().unsqueeze(-1).to(std.dtype)

    def unit_columns(self, params: Tree, train: ClientData) -> dict[str, np.ndarray]:
        """Per unit (clients,): ``recalibrate_at`` — when its mean predictive σ over its own
        calibration inputs reaches ``recalibrate_ratio`` times its value at t_i (module doc);
        NaN when no drift was learned (never) or no interval is stated."""
        if "drift_rate" not in params:
            return {}
        m = train.mask.to(F64)
        n = m.sum(1).clamp_min(1.0)
        v0 = ((self.predictive_std(params, train.x).to(F64)[..., 0] ** 2) * m).sum(1) / n
        at_ref = params["t_ref"].to(F64).unsqueeze(1).expand_as(m)
        one = self._drift_var(params, train.x, at_ref + 1.0)  # growth per unit of time
        growth = (one * m).sum(1) / n
        dt = (self.recalibrate_ratio**2 - 1.0) * v0 / growth
        when = torch.where(growth > 0, params["t_ref"].to(F64) + dt, math.nan)
        return {"recalibrate_at": when.numpy()}

    def export_state(self, server: Tree) -> dict:
        state = super().export_state(server)
        _, idx = self.chosen_features(server)
        q, scale = float(server["drift"]["q"]), float(server["drift"]["scale"])
        state["drift"] = {
            "model": "random walk of the coefficients, variance q·|t − t_i|·Σ/T",
            "q": q,
            "time_scale": scale,
            "rate_per_time": q / scale if scale > 0 else 0.0,
            "recalibrate_ratio": self.recalibrate_ratio,
            "seen": server["drift"]["seen"][idx][:, idx].tolist(),  # Π on the exported basis
        }
        if scale <= 0:
            state["drift"]["note"] = NO_TIME
        return state
