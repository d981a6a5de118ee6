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

Choosing q. Each round every unit uploads, for each q_k of :data:`DRIFT_GRID` (and its
span), two scores under the broadcast prior; the server adds them over units (in canonical
order, each weighted like its M-step statistics) and keeps the q_k of highest fleet score,
or q = 0 unless that beats q = 0 by ½ ``drift_test`` (1.92) nats. Round 0 has no time scale
yet and runs with q = 0. Which score (``drift_fit``):

* ``"future"`` (default): the unit's **held-out future**. The last ``drift_holdout`` (25 %)
  of its calibration span is held out; the posterior at the latest earlier row t_p, from the
  earlier rows whitened by q_k, predicts each held-out row as the unit would in use,
  N(φᵀm, σ² + φᵀVφ + (q_k/T)(t − t_p)φᵀΣ_dφ), and the score is the sum of the held-out
  rows' log densities (:meth:`FedPriorDrift._future_scores`). A walk that only absorbs the
  basis's misfit in time (a seasonal error of a too-small basis) does not predict the next
  period and is not chosen for it.
* ``"evidence"``: the in-sample log-evidence log p(y_i | μ, Σ, σ², q_k) (a likelihood-ratio
  test, χ²₁ at 5 %). On a generated 8-feature network with short co-locations
  (docs/field.md), with the walk prior, it chose a smaller basis and q = 0.18, and failed
  (13.15 µg/m³ mean).

Which prior (``drift_prior``):

* ``"static"`` (default): μ, Σ, σ² and the basis are fedprior's fit, bit for bit, whatever
  q; q acts in use only (each unit's posterior at t_i, whitened by q, and its σ growing after
  t_i). q = 0 is fedprior exactly, and q cannot change the model's form.
* ``"walk"``: the E-step's moments are whitened by the broadcast q (ECM): the prior, σ² and
  the basis are fitted under the walk. The σ² step treats R̄ as fixed at the broadcast σ² (a
  fixed-point step). On a planted walk it recovers the drift variance (within 1.6×, tested);
  "static" recovers less of it (0.6× on the planted test fleet) as its Σ and σ² also hold
  the walk's spread. On the field networks the walk prior chose a smaller basis and failed.

Consistency (issue 21's check, :func:`drift_problems`): the evidence grid must lie below
what the unit's rows allow at the broadcast σ², and at its E-step's q it must equal the
evidence the server recomputes from the unit's uploaded posterior moments
(:func:`evidence_from_upload`); the future scores below their bound; every upload, the
short step's too, finite. A grid above its bound is rejected like any inconsistent upload;
below it (and away from the E-step's q) nothing bounds it. The future scores, and the
evidence grid when ``drift_fit = "evidence"``, are bounded from above only, so the server
sums each unit's gain over q = 0, clipped
to ± ``drift_score_clip`` × its rows, and never the score at q = 0 itself
(:func:`bound_future_scores`: a huge common offset would swallow the honest margins in
float64); each declared span is capped at ``drift_span_cap`` × the median span before T is
formed (:func:`fleet_time_scale`): one forged unit moves the fleet by a bounded amount, not
arbitrarily.

Use. The prediction is φ(x)ᵀm_i (a random walk has no expected direction); the predictive
variance at time t adds the walk since t_i,

    Var = [fedprior's variance] + (q/T) · max(t − t_i, 0) · φ(x)ᵀ Σ_d φ(x),

(:meth:`predictive_std_timed`; φ is the guarded basis beyond the support box). The unit's
``recalibrate_at`` (per_sensor.csv) is when the mean predictive variance over its own
calibration inputs, v̄(t) = v̄₀ + d̄ (t − t_i), reaches ``recalibrate_ratio``² times v̄₀,
i.e. its σ has grown by that factor: t_i + (ratio² − 1) v̄₀ / d̄ (empty when q = 0: never).

Short co-locations (``short_colocation = "holdout"``, :mod:`~fedcal.algorithms.fedprior_short`):
a unit whose calibration span is below twice the fleet's shortest is in the short class; the
long units emulate such a co-location on their own rows, and the fleet learns how much the
class's own rows weigh (w*), how fast its relation ages (q_s) and its τ²_s (steps S1–S4).

Reduction: with q = 0 (planted or learned) and no short class (no unit has twice the
shortest span, or ``short_colocation = "off"``) every moment is fedprior's exactly, and so are
the predictions and intervals. Without a time column (e.g. chamber data) no unit has a
span, q stays 0 and the run is fedprior's; ``prior.json`` says so (``drift.note``).
Simplifications: the noise level in R̄ is the fleet's (also with ``noise = "sensor"``); the
hold-out of calibrated intervals (fedprior's I2) fits its probe rows without drift; the
firmware exports carry the variance at t_i (no drift term); client-level DP is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Literal

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from fedcal.algorithms.fedprior import FedPrior
from fedcal.algorithms.fedprior_choice_parts import fleet_time_scale
from fedcal.algorithms.fedprior_short import SHORT_WINDOWS, ShortColocation, unit_span, unit_times
from fedcal.core.algorithm import ClientResult, SettingError
from fedcal.core.bayes import F64, Moments, moments, posterior, safe_cholesky
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree, flatten

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
    # How q is chosen (module doc, "Choosing q"): "future", by each unit's own last rows held
    # out, with the prior, basis and σ² fitted without drift; "evidence", by the fleet's
    # in-sample evidence, the prior fitted under the walk (ECM).
    drift_fit: Literal["future", "evidence"] = "future"
    # "future": the last fraction of each unit's calibration span held out as its future
    drift_holdout: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.25
    # The prior's fit: "walk", its E-step whitened by the broadcast q (ECM: μ, Σ, σ² and the
    # basis fitted under the walk); "static", fedprior's fit (q acts in use only: the
    # personalized posterior at t_i and its σ growing after it).
    drift_prior: Literal["walk", "static"] = "static"
    # Hostile sites: each unit's future score gain over q = 0 is clipped to ± this many nats
    # per row it declares (:func:`bound_future_scores`); measured honest maxima 0.45 (field
    # network) and 1.64 (a planted strong walk) nats per row (docs/field.md).
    drift_score_clip: Annotated[float, Field(gt=0.0)] = 3.0
    # Hostile sites: a declared span counts at most this many times the fleet's median span
    # in the time scale T (:func:`fleet_time_scale`).
    drift_span_cap: Annotated[float, Field(gt=1.0)] = 32.0
    # Short co-locations (fedprior_short, S1–S4): "holdout", the long units emulate the
    # fleet's shortest span and the fleet learns how much a short unit's own rows weigh and
    # its τ²; "off": a short unit's posterior is fedprior_drift's like any other.
    short_colocation: Literal["holdout", "off"] = "holdout"
    # S2's emulated use (fedprior_short): "span", windows over a long unit's whole span, every
    # other row of it predicted (gaps and seasons up to the span away, as a short unit meets
    # in use); "future", windows before its last drift_holdout, which alone is predicted.
    short_emulation: Literal["future", "span", "far"] = "future"
    # Hostile sites: each unit's emulated squared errors' gains over w = 1 (S2) count at most
    # this many times its held-out rows × a typical unit's squared error per row at that w
    # (:func:`bound_short_sse`; honest units at most 6.8x on the field networks, docs/field.md).
    short_sse_clip: Annotated[float, Field(gt=0.0)] = 20.0

    name = "fedprior_drift"
    # A unit's drift evidences grow with its rows, like its residual terms: not screened.
    unscreened_replies = (*FedPrior.unscreened_replies, "drift/")

    @cached_property
    def short(self) -> ShortColocation:
        """Short co-locations, S1–S4 (fedprior_short), with the drift's grid of q."""
        return ShortColocation(
            mode=self.short_colocation,
            emulation=self.short_emulation,
            holdout_share=self.drift_holdout,
            test=self.drift_test,
            noise=self.noise,
            basis=self.design_basis,
            calibrated=self.calibrated,
            q_grid=DRIFT_GRID,
        )

    # ---- time (fedprior_short) ----------------------------------------------------------
    _time = staticmethod(unit_times)  # each row's time (0 without a time column)
    _span = staticmethod(unit_span)  # (t_i, span_i) per unit

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
    def _drift_parts(self, down: Tree, data: ClientData, mask: Tensor | None = None) -> Tree:
        """What every q shares: static moments, the eigenpairs of F, U and u (module doc);
        on the rows of ``mask`` (default: all real rows), anchored at their latest time."""
        t = self._time(data)
        mask = data.mask.to(F64) if mask is None else mask.to(F64)
        design = self.design(data.x, data.branch)
        full = moments(design, data.y[..., 0], mask)
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

    def check_task(self, task) -> None:
        super().check_task(task)
        if self.noise_model.weighted:  # its whitened moments assume one constant noise per unit
            raise SettingError(
                "noise_shape",
                "fedprior_drift supports noise_shape = 'constant' and noise_tail = 'gaussian' "
                "only (the drift's whitening is not weighted by row yet); use fedprior",
            )
        if self.own_folds and self.short_colocation == "holdout" and self.interval == "calibrated":
            # S2 learns τ²_s on windows without I4's τ²_own; in use they would add up
            raise SettingError(
                "own_folds",
                f"{self.own_folds} with short_colocation = 'holdout': the short step's τ² is "
                "learned without the own-row τ²; use own_folds = 0 or short_colocation = 'off'",
            )

    def _client_moments(self, down: Tree, data: ClientData) -> Moments:
        """fedprior's E-step moments: whitened by the broadcast drift q (static at q = 0);
        ``drift_prior = "static"``: the static ones."""
        if self.drift_prior == "static":
            return self._moments(data)
        return self._walk_moments(down, data)

    def _personal_moments(self, down: Tree, data: ClientData) -> Moments:
        """A unit's posterior at t_i: its moments whitened by the broadcast q (module doc),
        a short co-location's tempered by the fleet's w* (fedprior_short, S4)."""
        return self.short.personal_moments(down, data, self._walk_moments(down, data))

    def _walk_moments(self, down: Tree, data: ClientData) -> Moments:
        """The moments whitened by the broadcast drift q (static at q = 0)."""
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
            "future": torch.zeros_like(DRIFT_GRID),
            "short": self.short.init(),
        }
        return {**super().server_init(params), "drift": drift}

    def broadcast(self, server: Tree) -> Tree:
        return {
            **super().broadcast(server),
            "drift": {
                **{k: server["drift"][k] for k in ("q", "scale", "seen")},
                **self.short.broadcast(server["drift"]),
            },
        }

    def _grid_posterior(self, down: Tree, noise: Tensor, parts: Tree) -> tuple[Tensor, Tensor]:
        """(posterior per grid q (clients·K), −½ log|R̄| (clients, K)) under the broadcast
        prior, on the chosen basis (its unused terms see no data)."""
        c, k = parts["lam"].shape[0], len(DRIFT_GRID)
        w, logdet = self._whiten(parts, DRIFT_GRID.expand(c, -1), noise)
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

    def _future_scores(self, down: Tree, state: Tree, data: ClientData) -> Tensor:
        """(clients, K): each unit's predictive log score of its own future, for every q_k.

        The last ``drift_holdout`` of the unit's calibration span is held out; its posterior
        at the latest earlier row t_p (whitened by q_k, under the broadcast prior) predicts
        each held-out row r by N(φ_rᵀm, σ² + φ_rᵀVφ_r + (q_k/T)(t_r − t_p) φ_rᵀΣ_dφ_r), the
        interval the unit would state at t_r (module doc, Use), and the score is
        Σ_r log N(y_r; …). A unit without both parts (a single time) scores 0 for every q.
        """
        c, k = data.num_clients, len(DRIFT_GRID)
        t, mask = self._time(data), data.mask.to(F64)
        t_last, span = self._span(t, mask)
        fut = ((mask > 0) & (t > (t_last - self.drift_holdout * span).unsqueeze(1))).to(F64)
        past = mask - fut
        use = (past.sum(1) > 0) & (fut.sum(1) > 0) & (span > 0)
        if not bool(use.any()):
            return torch.zeros(c, k, dtype=F64)
        noise = self._noise(down, state).to(F64).reshape(-1)
        post, _ = self._grid_posterior(down, noise, self._drift_parts(down, data, past))
        design = self.design(data.x, data.branch).to(F64)
        if "mask" in down:  # the chosen basis's terms only
            design = design * down["mask"].to(F64).unsqueeze(1)
        p = design.shape[-1]
        mean, cov = post.mean.reshape(c, k, p), post.cov.reshape(c, k, p, p)
        pred = torch.einsum("crp,ckp->ckr", design, mean)
        spread_v = ((design.unsqueeze(1) @ cov) * design.unsqueeze(1)).sum(-1)  # φᵀVφ (c,K,r)
        t_past, _ = self._span(t, past)
        scale = down["drift"]["scale"].to(F64).reshape(-1)[0]
        dt = (t - t_past.unsqueeze(1)).clamp_min(0.0) / scale
        walk = ((design @ self._drift_cov(down)) * design).sum(-1) * dt  # (c, r)
        var = noise.reshape(-1, 1, 1) + spread_v + DRIFT_GRID.reshape(1, -1, 1) * walk.unsqueeze(1)
        resid = data.y[..., 0].to(F64).unsqueeze(1) - pred
        logp = -0.5 * (torch.log(2 * math.pi * var) + resid**2 / var)
        score = (logp * fut.unsqueeze(1)).sum(-1)
        return torch.where(use.unsqueeze(1), score, 0.0)

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        t = self._time(data)
        result = super().client_update(down, state, data)
        c = data.num_clients
        _, span = self._span(t, data.mask.to(F64))
        loglik = torch.zeros(c, len(DRIFT_GRID), dtype=F64)
        future = torch.zeros(c, len(DRIFT_GRID), dtype=F64)
        short = self.short.holdout(down, state, data)  # zeros (shape): no Σ_d yet
        if float(down["drift"]["scale"].reshape(-1)[0]) > 0:  # the fleet's time scale is known
            noise = down["noise_var"].to(F64).reshape(-1)
            post, half_logdet = self._grid_posterior(down, noise, self._drift_parts(down, data))
            loglik = post.loglik.reshape(c, -1) + half_logdet
            if self.drift_fit == "future":
                future = self._future_scores(down, state, data)
            short = self.short.holdout(down, state, data, self._drift_cov(down))  # S2
        drift = {"loglik": loglik, "future": future, "span": span, "short": short}
        reply = {**result.reply, "drift": drift}
        return ClientResult(reply, result.state, result.metrics)

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        drift = replies["drift"]
        stats = {k: v for k, v in replies.items() if k != "drift"}
        new = super().server_update(server, stats, weights)
        # The canonical order of fedprior's sums: the rounding cannot depend on arrival order.
        order = torch.from_numpy(np.lexsort(replies["mean"].numpy().T[::-1]).copy())
        loglik = drift["loglik"]
        # each unit's clipped gains over q = 0: the fleet's score is their sum (0 at q = 0)
        future = bound_future_scores(drift["future"], replies["n"], self.drift_score_clip)
        robust = self.outlier_weights(server, stats)  # q's evidence weighted like the M-step's
        if robust is not None and bool((robust.weights != 1).any()):
            loglik = loglik * robust.weights.unsqueeze(1)
            future = future * robust.weights.unsqueeze(1)
        # the evidence mode decides on clipped gains too (raw sums are checked from above
        # only: one unit lowering ℓ_i(q > 0) without limit would hold q at 0)
        evidence = bound_future_scores(drift["loglik"], replies["n"], self.drift_score_clip)
        if robust is not None and bool((robust.weights != 1).any()):
            evidence = evidence * robust.weights.unsqueeze(1)
        loglik, future = loglik[order].sum(0), future[order].sum(0)
        score = future if self.drift_fit == "future" else evidence[order].sum(0)
        old = server["drift"]
        q = torch.tensor(0.0, dtype=F64)
        if float(old["scale"]) > 0:  # the grid was evaluated this round
            k = int(torch.argmax(score))  # ties: the smaller q
            if float(score[k] - score[0]) > 0.5 * self.drift_test:
                q = DRIFT_GRID[k].clone()
        scale = fleet_time_scale(drift["span"], order, self.drift_span_cap)
        if float(old["scale"]) > 0:
            scale = old["scale"].clone()  # the time scale is fixed once known
        new["drift"] = {"q": q, "scale": scale.to(F64), "seen": self._seen(new), "loglik": loglik}
        new["drift"]["future"] = future
        # S1, S3 (fedprior_short): each unit's counts clipped to the rows it declares, its
        # scores and squared errors as clipped gains over q_s = 0 and w = 1 (their base dropped)
        sh = drift["short"]
        rows = SHORT_WINDOWS * replies["n"].to(F64)  # a row is held out by each window before it
        held = torch.minimum(sh["held"].clamp_min(0.0), rows)
        w_n, q_n = sh["score"].shape[1:]
        score = bound_future_scores(
            sh["score"].reshape(-1, q_n), rows.repeat_interleave(w_n, 0), self.drift_score_clip
        ).reshape(-1, w_n, q_n)
        sums = {
            "sse": bound_short_sse(sh["sse"], held, self.short_sse_clip)[order],
            "score": score[order],
            "inside": torch.minimum(sh["inside"].clamp_min(0.0), held.unsqueeze(1))[order],
            "held": held[order],
        }
        unit_w = torch.ones_like(held) if robust is None else robust.weights.to(F64)
        new["drift"]["short"] = self.short.update(old["short"], drift["span"], sums, unit_w[order])
        return new

    def inconsistent_replies(
        self, server: Tree, replies: Tree, weights: Tensor, accepted: Tensor
    ) -> dict[int, str] | None:
        """fedprior's checks (:mod:`fedcal.core.robust`), then each unit's drift uploads
        against its row count and the broadcast (:func:`drift_problems`)."""
        whys = super().inconsistent_replies(server, replies, weights, accepted)
        if whys is None:
            return None
        idx = accepted.nonzero()[:, 0]
        if not len(idx):
            return whys
        sub = {k: v.index_select(0, idx) for k, v in flatten(replies).items()}
        main = None
        if self.noise == "fleet":  # the grid's σ² is the E-step's (per-unit σ_i²: no identity)
            main = {k: sub[k] for k in ("mean", "second", "rss", "gram", "n")}
        found = drift_problems(
            sub["drift/loglik"],
            sub["drift/future"],
            sub["drift/span"],
            sub["n"],
            server,
            main,
            future_bound=self.noise == "fleet",
            e_step_q=0.0 if self.drift_prior == "static" else float(server["drift"]["q"]),
            short=_short_uploads(sub),
        )
        for j, why in found.items():
            whys.setdefault(int(idx[j]), why)
        return whys

    def _seen(self, server: Tree) -> Tensor:
        """The projection onto the directions of the basis in use that at least
        ``min_informed`` units' data determine (fedprior's identification rule)."""
        _, idx = self.selection.chosen_features(server)
        support = server["support"][idx][:, idx]
        vals, vecs = torch.linalg.eigh(0.5 * (support + support.T))
        keep = vecs[:, vals >= self.min_informed]
        seen = torch.zeros(self.num_features, self.num_features, dtype=F64)
        seen[idx.unsqueeze(1), idx.unsqueeze(0)] = keep @ keep.T
        return seen

    def personal_shapes(self) -> dict[str, tuple[int, ...]]:
        p = self.num_features
        return {**super().personal_shapes(), "t_ref": (), "drift_rate": (), "drift_cov": (p, p)}

    def _personal(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        out = super()._personal(down, state, data)
        if "drift" not in down:  # a prior without drift (e.g. read back from prior.json)
            return out
        t_ref, _ = self._span(self._time(data), data.mask.to(F64))
        q, scale = down["drift"]["q"].to(F64), down["drift"]["scale"].to(F64)
        rate = torch.where(scale > 0, q / scale.clamp_min(1e-300), 0.0).reshape(-1)
        out.update(t_ref=t_ref, drift_rate=rate.expand_as(t_ref), drift_cov=self._drift_cov(down))
        return self.short.use(down, data, out)  # S4: the short class's rate and τ²_s

    def _gram_counts_rows(self, server: Tree) -> bool:
        # With q > 0 and drift_fit = "evidence" the E-step's Gram is whitened, G̃ = ΦᵀR̄⁻¹Φ: its
        # constant term 1ᵀR̄⁻¹1 is below n (still PSD, and the GLS identities still hold, so
        # those are checked). "future" uploads the static moments.
        return self.drift_prior == "static" or not float(server["drift"]["q"]) > 0

    def dp_statistics(self, down: Tree):
        raise ValueError("fedprior_drift: client-level DP is not covered (use fedprior)")

    # ---- use ---------------------------------------------------------------------------
    def _drift_var(self, params: Tree, x: Tensor, time: Tensor) -> Tensor:
        """(q/T) · max(t − t_i, 0) · φ(x)ᵀ Σ_d φ(x) per row (clients, rows)."""
        p = len(self.terms)
        phi, _ = self.support_box.guarded(params, x.to(F64))
        cov = params["drift_cov"].to(F64)[..., :p, :p]
        spread = ((phi @ cov) * phi).sum(-1)
        dt = (time.to(F64) - params["t_ref"].to(F64).unsqueeze(1)).clamp_min(0.0)
        return params["drift_rate"].to(F64).unsqueeze(1) * dt * spread

    def predictive_std_timed(self, params: Tree, data: ClientData) -> Tensor:
        """:meth:`predictive_std` at each row's time: + the walk since t_i (module doc)."""
        std = self.predictive_std(params, data.x)
        if data.time is None or "drift_rate" not in params:
            return self.time_choice.forward.std(params, data, std)  # fedprior_forward's, after t_i
        var = std.to(F64)[..., 0] ** 2 + self._drift_var(params, data.x, data.time)
        return self.time_choice.forward.std(params, data, var.sqrt().unsqueeze(-1).to(std.dtype))

    def unit_columns(self, params: Tree, train: ClientData) -> dict[str, np.ndarray]:
        """Per unit (clients,): ``recalibrate_at`` — when its mean predictive σ over its own
        calibration inputs reaches ``recalibrate_ratio`` times its value at t_i (module doc);
        NaN when no drift was learned (never) or no interval is stated."""
        extra = super().unit_columns(params, train)  # fedprior's (fallback)
        if "drift_rate" not in params:
            return extra
        m = train.mask.to(F64)
        n = m.sum(1).clamp_min(1.0)
        v0 = ((self.predictive_std(params, train.x).to(F64)[..., 0] ** 2) * m).sum(1) / n
        at_ref = params["t_ref"].to(F64).unsqueeze(1).expand_as(m)
        one = self._drift_var(params, train.x, at_ref + 1.0)  # growth per unit of time
        growth = (one * m).sum(1) / n
        dt = (self.recalibrate_ratio**2 - 1.0) * v0 / growth
        when = torch.where(growth > 0, params["t_ref"].to(F64) + dt, math.nan)
        return {**extra, "recalibrate_at": when.numpy()}

    def export_state(self, server: Tree) -> dict:
        state = super().export_state(server)
        _, idx = self.selection.chosen_features(server)
        q, scale = float(server["drift"]["q"]), float(server["drift"]["scale"])
        state["drift"] = {
            "model": "random walk of the coefficients, variance q·|t − t_i|·Σ/T",
            "q": q,
            "time_scale": scale,
            "rate_per_time": q / scale if scale > 0 else 0.0,
            "recalibrate_ratio": self.recalibrate_ratio,
            "fit": self.drift_fit,
            "prior": self.drift_prior,
            "seen": server["drift"]["seen"][idx][:, idx].tolist(),  # Π on the exported basis
        }
        short = server["drift"]["short"]
        if float(short["held"]) > 0:  # S1–S3 (fedprior_short): what a short new unit gets
            tau = float(short["tau"])
            state["drift"]["short"] = {
                "window": float(short["window"]),
                "temper": float(short["temper"]),
                "q": float(short["q"]),
                "tau": None if math.isnan(tau) else tau,
                "held": float(short["held"]),
            }
        if scale <= 0:
            state["drift"]["note"] = NO_TIME
        return state


#: Tolerance of the drift uploads' checks, in nats per (1 + |log-evidence| + rows): a
#: consistent upload's rounding is ~1e-13 of that (measured on the planted test fleet of
#: tests/algorithms/test_fedprior_drift.py, q = 0).
EVIDENCE_TOL = 1e-6


def evidence_from_upload(main: Tree, server: Tree) -> Tensor:
    """(clients,) the log-evidence log p(y_i | μ, Σ, σ², q) of the E-step a unit uploaded
    (mean m, second moment S, expected RSS r, Gram G of its, possibly whitened, moments),
    less its −½ log|R̄| (0 at q = 0), recomputed by the server:

        −2 log p = n log 2πσ² + log|A| + (r − tr(G V))/σ² + (m − μ)ᵀΣ⁻¹(m − μ),

    A = I + LᵀGL/σ² (Σ = L Lᵀ, G restricted to the chosen basis), V = S − m mᵀ: the
    Woodbury form of :func:`fedcal.core.bayes.posterior`'s, as ‖y − Φm‖² = r − tr(G V) and
    ‖y − Φμ‖²/σ² − gᵀA⁻¹g = ‖y − Φm‖²/σ² + (m − μ)ᵀΣ⁻¹(m − μ) at the posterior mean."""
    mu, sigma = server["mu"].to(F64), server["sigma"].to(F64)
    s2 = server["noise_var"].to(F64).reshape(-1)
    m, second = main["mean"].to(F64), main["second"].to(F64)
    gram = main["gram"].to(F64)
    if "mask" in server:
        mm = server["mask"].to(F64)
        gram = gram * mm.unsqueeze(-1) * mm
    p = m.shape[-1]
    chol = safe_cholesky(0.5 * (sigma + sigma.T))[0]
    lg = chol.T @ gram @ chol / s2.reshape(-1, 1, 1)
    logdet_a = torch.linalg.slogdet(torch.eye(p, dtype=F64) + 0.5 * (lg + lg.transpose(1, 2)))[1]
    v = second - m.unsqueeze(-1) * m.unsqueeze(-2)
    fit = main["rss"].to(F64) - (gram * v).sum((-2, -1))
    z = torch.linalg.solve_triangular(chol, (m - mu).unsqueeze(-1), upper=False)[..., 0]
    n = main["n"].to(F64)
    return -0.5 * (n * torch.log(2 * math.pi * s2) + logdet_a + fit / s2 + (z * z).sum(-1))


def bound_future_scores(future: Tensor, n: Tensor, clip: float) -> Tensor:
    """Each unit's future scores as its gains over q = 0, g_i(q_k) = s_i(q_k) − s_i(0),
    clipped to ± ``clip`` · n_i nats (column 0 exactly 0).

    The server keeps the q_k of highest Σ_i g_i(q_k) (module doc, "Choosing q"): only the
    differences s_i(q_k) − s_i(0) choose. :func:`drift_problems` bounds s_i from above only,
    so a unit lowering its s_i(0) would move the fleet's choice by as many nats as it
    forges; clipped per unit, one unit moves the fleet's gain by at most ``clip`` · n_i. The
    base s_i(0) itself is dropped, not summed: an unbounded base (a huge negative one, the
    same at every q) would otherwise swallow the honest units' margins in float64 and leave
    every column tied (q = 0).
    """
    bound = (clip * n.to(F64).reshape(-1, 1)).expand_as(future)
    return torch.maximum(torch.minimum(future - future[:, :1], bound), -bound)


def bound_short_sse(sse: Tensor, held: Tensor, clip: float) -> Tensor:
    """Each unit's emulated squared errors (clients, W) as its gains over w = 1 (the last
    column), sse_i(w) − sse_i(1), clipped to ± clip · h_i · s_w (last column exactly 0).

    The server keeps the w of least summed gain (fedprior_short S3); only the differences
    between columns choose, and the server cannot recompute a unit's sums without its
    held-out rows, so a unit forging them (a huge error at every w but the one it wants)
    would move the fleet's choice by as much as it forges. h_i: the rows it held out
    (already capped at its declared rows); s_w: the median over the units that held rows
    out of max(sse_i(w), sse_i(1)) / h_i, a typical unit's squared error per row (robust: a
    minority of forgers cannot move it far; an honest unit's gain is at most its own
    max(sse_i(w), sse_i(1))). Clipped, one unit moves the fleet's preference of any w over
    w = 1 by at most clip · h_i · s_w, as the drift's future scores are clipped
    (:func:`bound_future_scores`). The base sse_i(1) itself is dropped, not summed: an
    unbounded base (the same huge value at every w) would otherwise swallow the honest
    units' margins in float64 and leave every column tied (w = 1).
    """
    sse = sse.to(F64).clamp_min(0.0)
    held = held.to(F64)
    gain = sse - sse[:, -1:]
    some = held > 0
    if not bool(some.any()):
        return gain
    level = torch.maximum(sse, sse[:, -1:])[some] / held[some].unsqueeze(1)
    scale = level.median(0).values  # (W,)
    bound = clip * held.unsqueeze(1) * scale.unsqueeze(0)
    return torch.maximum(torch.minimum(gain, bound), -bound)


def _short_uploads(flat: Tree) -> Tensor | None:
    """(clients, k): a unit's short-step uploads (``drift/short/…``) side by side."""
    keys = sorted(k for k in flat if k.startswith("drift/short/"))
    if not keys:
        return None
    return torch.cat([flat[k].to(F64).reshape(flat[k].shape[0], -1) for k in keys], 1)


def drift_problems(
    loglik: Tensor,
    future: Tensor,
    span: Tensor,
    n: Tensor,
    server: Tree,
    main: Tree | None,
    future_bound: bool = True,
    e_step_q: float | None = None,
    short: Tensor | None = None,
) -> dict[int, str]:
    """Units whose drift uploads cannot be what their declared rows give, with why.

    For every q of the grid the unit's rows are y ~ N(Φμ, C(q)), C(q) = σ²R̄ + ΦΣΦᵀ ⪰ σ²I,
    with log-evidence ℓ(q) = −½[n log 2π + log|C(q)| + rᵀC(q)⁻¹r] (r = y − Φμ), so

    a. every ℓ(q_k), every future score and every short-step upload (``short``, (clients,
       k): fedprior_short S2's sums, flattened) is finite, and the span ≥ 0; before the fleet's
       time scale is known (round 0) the grid is not evaluated: every entry 0;
    b. ℓ(q_k) ≤ −½ n log 2πσ² (|C| ≥ σ²ⁿ, rᵀC⁻¹r ≥ 0), n the unit's row count;
    c. at the q of its E-step (``e_step_q``, default the broadcast q), ℓ(q) + ½ log|R̄| is
       the evidence of the E-step it uploaded
       (:func:`evidence_from_upload`): equal at q = 0 (R̄ = I), ℓ(q) ≤ it for q > 0; needs
       the E-step's σ² to be the broadcast one (``main`` None: not checked);
    d. (``future_bound``, the broadcast σ²) each held-out row's predictive variance is
       ≥ σ², so a future score ≤ n · max(0, −½ log 2πσ²).

    A forged grid that lowers ℓ(0) (to make drift look better) fails c; one raising any
    ℓ(q_k) above what n rows at noise σ² allow fails b. What c and b leave open is bounded:
    a unit can raise ℓ(q_k) for q_k above the broadcast q by at most ½rᵀC⁻¹r.
    """
    s2 = server["noise_var"].to(F64).reshape(-1)
    rows = n.to(F64)
    cap = -0.5 * rows * torch.log(2 * math.pi * s2)
    tol = EVIDENCE_TOL * (1.0 + loglik.abs().amax(-1) + rows)
    q = float(server["drift"]["q"]) if e_step_q is None else e_step_q
    out: dict[int, str] = {}
    finite = torch.isfinite(loglik).all(-1) & torch.isfinite(future).all(-1)
    finite &= torch.isfinite(span) & (span >= 0)
    if short is not None:
        finite &= torch.isfinite(short).all(-1)
    high = loglik.amax(-1) > cap + tol
    gap = None
    if main is not None:
        at = int(torch.argmin((DRIFT_GRID - q).abs()))
        gap = loglik[:, at] - evidence_from_upload(main, server)
    fut_cap = rows * torch.clamp_min(-0.5 * torch.log(2 * math.pi * s2), 0.0)
    fut_high = future.amax(-1) > fut_cap + tol if future_bound else torch.zeros_like(high)
    unset = float(server["drift"]["scale"]) <= 0  # round 0: no grid evaluated
    for i in range(len(rows)):
        if not bool(finite[i]):
            out[i] = "drift evidence, span or short-step sums not finite (or a negative span)"
        elif unset:
            if bool((loglik[i] != 0).any() | (future[i] != 0).any()):
                out[i] = "drift evidence uploaded before the fleet's time scale is known"
        elif bool(high[i]):
            out[i] = (
                f"drift evidence {float(loglik[i].amax()):.6g} above what {float(rows[i]):g} rows "
                f"at the broadcast noise allow ({float(cap[i]):.6g})"
            )
        elif gap is not None and (
            abs(float(gap[i])) > float(tol[i]) if q == 0 else float(gap[i]) > float(tol[i])
        ):
            out[i] = (
                f"drift evidence at q = {q:g} disagrees with its E-step's by {float(gap[i]):.3g}"
            )
        elif bool(fut_high[i]):
            out[i] = (
                f"future score {float(future[i].amax()):.6g} above what {float(rows[i]):g} rows "
                f"at the broadcast noise allow ({float(fut_cap[i]):.6g})"
            )
    return out
