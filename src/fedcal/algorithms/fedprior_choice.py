"""Model choice that respects time, with the simple fits as candidates, and no harm (issue 34).

A field unit is used on its *future*: what it ships is chosen by how it predicts its own
later rows, not by in-sample evidence (BIC rewards a basis that explains the past, e.g. a
seasonal error). :class:`TimeChoice` is a part of :class:`~fedcal.algorithms.fedprior.FedPrior`
(its ``time_choice``; fedprior_drift's too), acting with a time column (``choose``: "auto",
"time" = also row order as time, "off"), declared by the settings it reads (``choice_*``,
``implausible``, ``noise``, the raw reading), the number of inputs and the parts it uses:
the design basis (fedprior_basis), the selection's candidates (fedprior_select) and the
interval after calibration (``forward``,
:class:`~fedcal.algorithms.fedprior_forward.ForwardInterval`).
The model it scores (a unit's posterior from its early rows, its prediction and stated σ) is
passed to the methods that need it (:class:`~fedcal.algorithms.fedprior_forward.UnitModel`).

**Forward chaining.** Each unit's n calibration rows, ranked in time order (ties: row order),
give two folds: fit on the first ⌊(1 − 2h)n⌋ and score the next ones up to ⌊(1 − h)n⌋; fit on
those and score the rest (h = ``choice_holdout``, 0.25). A fold counts only if it fits at
least (linear terms + 1) rows (:meth:`TimeChoice.folds`). Candidates:

* every basis the fleet prior may use (``select = "bic"``'s candidates; without selection the
  basis in use), each unit's posterior under that candidate's broadcast prior from its early
  rows (:func:`fedcal.core.bayes.posterior`);
* **own linear**: the unit's own least-squares line (with intercept) from its early rows;
* **pooled linear**: per fold one least-squares line from the fleet's summed early-row
  moments (Σ_i Φ_iᵀΦ_i, Σ_i Φ_iᵀy_i on the constant and first-order terms: sums only leave a
  unit); the line shipped on fall-back from the screened Grams and posterior means,
  Σ_i G_i,lin b = Σ_i (G_i m_i)_lin (:mod:`~fedcal.algorithms.fedprior_choice_checks`);
* **raw**: the uncorrected reading, where a feature measures the target itself
  (``[data] raw_column``: ``raw_input`` and its map into the scaled target, ``raw_map``).

Each unit's score of a candidate is its validation MSE over both folds' scored rows, as
s_ik = clip(log(MSE_ik / min_k MSE_ik), 0, ``choice_clip``): scale-free, so a unit with
many rows or large values does not outvote the others, and bounded, so no unit moves the
fleet's sum by more than ``choice_clip`` nats. The server adds them (canonical order) and
keeps the basis of least Σ_i s_ik in place of the BIC (ties: the smaller basis). The
simple candidates' sums are reported beside the bases' (prior.json ``selection``).

**No harm** (per unit, at personalization, on its own rows only): the unit's model (its
posterior, fitted on its early rows the same way) and its best simple candidate are compared
row by row on the scored rows, d_r = e_model,r² − e_simple,r². When mean(d) exceeds
``choice_margin`` (0.1) × the simple candidate's MSE plus ``choice_z`` (2) standard errors
(2 SE alone let 3 of 30 honest units of a planted drift fleet fall back: a time series'
rows are correlated), the unit ships that candidate (fitted on all its rows: own line; the
fleet's pooled line; the raw reading) with its validation MSE as σ_i². per_sensor.csv
``fallback``: prior, own_linear, pooled_linear, raw. ``choice_sigma = "scale"`` (off by
default, :func:`~fedcal.algorithms.fedprior_forward.scale_sigma`) also scales each unit's σ
by its last quarter.

**Implausible units** (:meth:`TimeChoice.implausible_units`): validation RMSE or mean
predictive σ, over the unit's own target spread, beyond ``implausible`` (5) × the fleet's
median: ``weak`` (docs/statuses.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedcal.algorithms.fedprior_basis import DesignBasis, model_mask, unit_noise
from fedcal.algorithms.fedprior_choice_checks import fitted_rhs
from fedcal.algorithms.fedprior_choice_parts import (
    FOLDS,
    fleet_time_scale,
    late_sse,
    linear_index,
    pick_err,
    pick_mse,
    pooled_lines,
    repeat_moments,
    ridge_solve,
    row_times,
    ship_simple,
    subset,
)
from fedcal.algorithms.fedprior_forward import (
    FORWARD_KEYS,
    ForwardInterval,
    UnitModel,
    bound_terms,
    forward_fit,
    forward_record,
    scale_sigma,
    stated_var,
)
from fedcal.algorithms.fedprior_select import EvidenceSelection, _masked
from fedcal.core.algorithm import fleet_medians
from fedcal.core.bayes import F64, Moments, moments, posterior
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree

SIMPLE = ("own_linear", "pooled_linear", "raw")
MIN_SCORED = 5  # scored rows a unit needs before the no-harm test may replace its model
CHOICE_KEYS = (
    "pooled_fold",
    "pooled_all",
    "pooled_ok",
    "forward_scores",
    "forward_scored",
    *FORWARD_KEYS,
    "fwd_check",
)
SPAN_CAP = 32.0  # a declared span counts at most this × the median in T (as fedprior_drift)


@dataclass(frozen=True)
class TimeChoice:
    """Forward-chaining choice, simple candidates and the no-harm fall-back (module doc),
    declared by what it reads; the interval after calibration is its ``forward`` part."""

    choose: str  # "auto", "time" or "off"
    holdout: float  # h: the share of a unit's calibration span each forward fold scores
    clip: float  # a unit's score of a candidate is clipped to this (nats)
    z: float  # no harm: standard errors the model must lose by
    margin: float  # ... and this share of the simple candidate's validation MSE
    sigma: str  # "scale": each unit's σ scaled by its last quarter; "off"
    implausible: float  # a unit beyond this × the fleet's median is "weak"
    noise: str  # "fleet" or "sensor": the σ² a unit's early fit uses (fedprior_basis)
    raw_input: int  # the input that reads the target itself (-1: none)
    raw_map: tuple[float, float]  # its map into the scaled target
    inputs: int
    basis: DesignBasis
    selection: EvidenceSelection
    forward: ForwardInterval

    @property
    def labels(self) -> dict[str, tuple[str, ...]]:
        """The ``fallback`` column's names (its codes: 0 the prior's model, then SIMPLE)."""
        return {"fallback": ("prior", *SIMPLE)}

    def raw_map_of(self, scaler: Any) -> tuple[float, float]:
        """``raw_map`` from the run's scaler (``raw_input`` ≥ 0): y = x_raw in data units is
        y_s = (x_s·s_x + o_x − o_y) / s_y in scaled units."""
        j = self.raw_input
        x_off, x_sc = float(np.ravel(scaler.x_offset)[j]), float(np.ravel(scaler.x_scale)[j])
        y_off, y_sc = float(np.ravel(scaler.y_offset)[0]), float(np.ravel(scaler.y_scale)[0])
        return ((x_off - y_off) / y_sc, x_sc / y_sc)

    # ---- when and on what ----------------------------------------------------------
    @property
    def on(self) -> bool:
        """Whether the choice's state and uploads exist (``choose`` not "off", a basis with
        the constant and every first-order term)."""
        return self.choose != "off" and self.linear_terms is not None

    def choosing(self, data: ClientData) -> bool:
        """Whether the time-respecting choice acts on these data (``choose``)."""
        if not self.on:
            return False
        return self.choose == "time" or data.time is not None

    @cached_property
    def linear_terms(self) -> list[int] | None:
        """Indices in φ's terms of the constant and each input's first-order term."""
        return linear_index(self.basis.terms, self.inputs)

    @property
    def candidates(self) -> int:
        """The bases scored: every candidate with ``select = "bic"``'s own EMs, else one."""
        return len(self.selection.candidates) if self.selection.each_candidate else 1

    def folds(self, data: ClientData) -> list[tuple[Tensor, Tensor]]:
        """(fit, scored) row masks (clients, rows) of the forward-chaining folds, cut by each
        row's rank in its unit's time order (ties: row order), so that a unit whose rows share
        one time stamp still has folds. A fold counts for a unit only if it fits at least
        (linear terms + 1) rows; otherwise its scored rows are none (a unit with no counted
        fold is unscored)."""
        t, real = row_times(data), data.mask > 0
        order = torch.argsort(torch.where(real, t, math.inf), dim=1, stable=True)
        rank = torch.argsort(order, dim=1).to(F64)
        n = real.sum(1, keepdim=True).to(F64)
        h = self.holdout
        # fold k (0..FOLDS-1): fit the rows before the (FOLDS - k)-th last h, score that h
        cuts = [torch.floor((1 - j * h) * n) for j in range(FOLDS, -1, -1)]  # ..., 1 - h, 1
        least = len(self.linear_terms or [0]) + 1
        out = []
        for k in range(FOLDS):
            fit = real & (rank < cuts[k])
            scored = real & (rank >= cuts[k]) & (rank < cuts[k + 1])
            scored = scored & (fit.sum(1, keepdim=True) >= least)
            out.append((fit.to(F64), scored.to(F64)))
        return out

    @cached_property
    def raw_coef(self) -> Tensor | None:
        """The raw reading y = α + β·x_raw (scaled) as coefficients of the design
        (normalized Legendre: P̃₀ = 1, P̃₁(x) = √3·x)."""
        lin = self.linear_terms
        if self.raw_input < 0 or lin is None or self.raw_input >= self.inputs:
            return None
        coef = torch.zeros(len(self.basis.terms) + len(self.basis.branch_terms), dtype=F64)
        coef[lin[0]] = self.raw_map[0]
        coef[lin[1 + self.raw_input]] = self.raw_map[1] / math.sqrt(3.0)
        return coef

    # ---- client: the uploads -----------------------------------------------------------
    def uploads(
        self,
        model: UnitModel,
        down: Tree,
        state: Tree,
        data: ClientData,
        gram: Tensor,
        mean: Tensor,
    ) -> Tree:
        """A unit's scores of every candidate, its folds' linear moments and (G m) on the
        linear terms (``gram``, ``mean``: its design Gram and posterior mean as uploaded;
        fedprior_choice_checks); the forward interval's fold terms of ``model``."""
        design = self.basis.design(data.x, data.branch)
        y = data.y[..., 0].to(F64)
        lin = torch.tensor(self.linear_terms)
        pooled = pooled_lines(down, len(lin))
        sse, grams, rhss, rows = [], [], [], torch.zeros(data.num_clients, dtype=F64)
        fwd = []
        for k, (fit, scored) in enumerate(self.folds(data)):
            if self.forward.on:
                fwd.append(self.forward.fold(model, down, state, data, fit, scored))
            early, late = moments(design, y, fit), moments(design, y, scored)
            rows = rows + late.n
            coefs = self._candidate_coefs(down, state, early)  # (clients, K, p)
            g = early.gram[:, lin][:, :, lin]
            r = early.rhs[:, lin]
            grams.append(g)
            rhss.append(r)
            simple = torch.zeros(data.num_clients, 3, design.shape[-1], dtype=F64)
            simple[:, 0, lin] = ridge_solve(g, r)
            if pooled is not None:
                simple[:, 1, lin] = pooled[0][:, k]
            if self.raw_coef is not None:
                simple[:, 2] = self.raw_coef
            both = torch.cat([coefs, simple], 1)
            sse.append(late_sse(repeat_moments(late, both.shape[1]), both))
        mse = sum(sse) / rows.clamp_min(1.0).unsqueeze(1)
        have = torch.ones(mse.shape[1], dtype=torch.bool)
        have[-2] = pooled is not None
        have[-1] = self.raw_coef is not None
        best = torch.where(have, mse, math.inf).amin(1, keepdim=True).clamp_min(1e-300)
        score = torch.log(mse.clamp_min(1e-300) / best).clamp(0.0, self.clip)
        score = torch.where(have & (rows > 0).unsqueeze(1), score, 0.0)
        t, real = row_times(data), data.mask > 0
        span = torch.where(real, t, -math.inf).amax(1) - torch.where(real, t, math.inf).amin(1)
        return {
            "score": score,
            "scored": (rows > 0).to(F64),
            "lin_gram": torch.stack(grams, 1),
            "lin_rhs": torch.stack(rhss, 1),
            "fit_rhs": fitted_rhs(gram, mean, lin),
            "span": torch.where(real.any(1), span, 0.0),
            "span_n": torch.ones(data.num_clients, dtype=F64),
            **{f"fwd_{k}": torch.stack([f[k] for f in fwd], 1) for k in (fwd or [{}])[0]},
        }

    def _candidate_coefs(self, down: Tree, state: Tree, early: Moments) -> Tensor:
        """(clients, K, p): each basis candidate's posterior mean from the early rows."""
        if not self.selection.each_candidate:  # the basis in use only
            mask = model_mask(down)
            stats = early if mask is None else _masked(early, mask)
            noise = unit_noise(self.noise, down, state)
            post = posterior(stats, down["mu"], down["sigma"], noise)
            coef = post.mean if mask is None else post.mean * mask
            return coef.unsqueeze(1)
        stats, c, p, k = self.selection.candidate_moments(down, early)
        cand = down["cand"]
        noise = state["cand_noise_var"] if self.noise == "sensor" else cand["noise_var"]
        post = posterior(
            stats,
            cand["mu"].reshape(-1, p),
            cand["sigma"].reshape(-1, p, p),
            noise.reshape(-1),
        )
        return post.mean.reshape(c, k, p) * self.selection.masks.unsqueeze(0)

    # ---- server ------------------------------------------------------------------------
    def update(self, replies: Tree, order: Tensor, gram: Tensor, per_unit: bool) -> Tree:
        """The pooled lines and the fleet's summed scores. ``per_unit`` (not streamed sums):
        each unit's score clipped to [0, ``choice_clip``], ``scored`` to [0, 1], non-finite
        entries 0 (the consistency check refuses such replies; this bounds them without it).
        The line on all rows is fitted from (Σ G_i,lin, Σ (G_i m_i)_lin) of the screened
        Grams and posterior means (fedprior_choice_checks), the folds' from their moments."""
        fwd = {k[4:]: v for k, v in replies.items() if k.startswith("fwd_")}
        span, span_n = replies.get("span"), replies.get("span_n")
        drop = ("span", "span_n")
        replies = {k: v for k, v in replies.items() if not k.startswith("fwd_") and k not in drop}
        if per_unit:
            replies = {
                k: torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0) for k, v in replies.items()
            }
            replies["score"] = replies["score"].clamp(0.0, self.clip)
            replies["scored"] = replies["scored"].clamp(0.0, 1.0)  # (× an outlier weight)
            fwd = bound_terms(fwd) if fwd else fwd
        total = {k: v[order].sum(0) for k, v in replies.items()}
        lin = torch.tensor(self.linear_terms)
        g = gram[order].sum(0).to(F64)[lin][:, lin]
        out = {
            "pooled_fold": ridge_solve(total["lin_gram"], total["lin_rhs"]),
            "pooled_all": ridge_solve(g, total["fit_rhs"]),
            "pooled_ok": torch.tensor(1.0, dtype=F64),
            "forward_scores": total["score"],
            "forward_scored": total["scored"],
        }
        if fwd and span is not None:  # the interval after calibration (fedprior_forward)
            span = torch.nan_to_num(span.to(F64), nan=0.0, posinf=0.0).clamp_min(0.0)
            if per_unit:  # T: the mean span, each capped (as fedprior_drift's)
                scale = fleet_time_scale(span, order, SPAN_CAP)
            else:  # streamed sums: Σ span / Σ units
                scale = span.sum() / span_n.to(F64).sum().clamp_min(1.0)
            out.update(forward_fit({k: v[order].sum(0) for k, v in fwd.items()}, scale))
        return out

    def pick(self, scores: Tensor) -> int:
        """The basis of least summed score (ties: the smaller, listed first)."""
        return int(torch.argmin(scores[: self.candidates]))

    def record(self, server: Tree) -> dict[str, Any] | None:
        """prior.json's record of the time-respecting choice (None when it did not act)."""
        if "forward_scored" not in server or not float(server["forward_scored"]) > 0:
            return None
        names = [str(c) if c else "basis in use" for c in self.selection.candidates]
        names = names if self.selection.each_candidate else ["basis in use"]
        scores = [round(float(v), 3) for v in server["forward_scores"]]
        have = [True] * len(names) + [True, True, self.raw_coef is not None]
        ranked = sorted(
            (s, n) for s, n, h in zip(scores, [*names, *SIMPLE], have, strict=True) if h
        )
        return {
            "rule": "forward-chaining validation (each unit's last quarters of its own span)",
            "units_scored": float(server["forward_scored"]),
            "candidates": [*names, *SIMPLE],
            "scores": scores,
            "ranked": [{"candidate": n, "score": s} for s, n in ranked],
            "note": "score: Σ over units of clip(log(MSE / the unit's best MSE), 0, "
            f"{self.clip:g}); lower is better; simple candidates are shipped per unit "
            "by the no-harm fall-back",
            **({"interval": forward_record(server)} if "fwd_scale" in server else {}),
        }

    # ---- client: no harm at personalization ----------------------------------------------
    def no_harm(self, model: UnitModel, down: Tree, state: Tree, data: ClientData, out: Tree):
        """The unit's model ``out``, or its best simple candidate where that predicted its
        own future better by more than ``choice_z`` standard errors (module doc); ``model``
        fits the unit's early rows the same way."""
        c = data.num_clients
        out["fallback"] = torch.zeros(c, dtype=F64)
        out["val_mse"] = torch.full((c,), -1.0, dtype=F64)  # -1: not measured (finite)
        out["sigma_scale"] = torch.ones(c, dtype=F64)
        m, y = data.mask.to(F64), data.y[..., 0].to(F64)
        count = m.sum(1).clamp_min(1.0)
        mean = (y * m).sum(1) / count
        out["target_sd"] = (((y - mean.unsqueeze(1)) ** 2 * m).sum(1) / count).sqrt()
        if self.forward.on:  # κ, ρ/T after calibration
            out = self.forward.personal(down, data, out)
        if not self.choosing(data):
            return out
        lin = torch.tensor(self.linear_terms)
        design = self.basis.design(data.x, data.branch)
        err = torch.zeros(4, *y.shape, dtype=F64)  # model, own, pooled, raw: squared errors
        scored_all = torch.zeros_like(y)
        stated = torch.zeros_like(y)  # the early fit's stated predictive variance there
        pooled = pooled_lines(down, len(lin))
        for k, (fit, scored) in enumerate(self.folds(data)):
            early = model._personal(down, state, subset(data, fit))
            pred = model.predict(early, data.x.to(F64))[..., 0].to(F64)
            err[0] += scored * (pred - y) ** 2
            if k == FOLDS - 1:  # σ: the fold most like use (fit on all but the last h)
                stated = scored * stated_var(model, early, data)
                last = scored
            em = moments(design, y, fit)
            own = ridge_solve(em.gram[:, lin][:, :, lin], em.rhs[:, lin])
            err[1] += scored * ((design[..., lin] * own.unsqueeze(1)).sum(-1) - y) ** 2
            if pooled is not None:
                line = (design[..., lin] * pooled[0][:, k].unsqueeze(1)).sum(-1)
                err[2] += scored * (line - y) ** 2
            if self.raw_coef is not None:
                err[3] += scored * ((design * self.raw_coef).sum(-1) - y) ** 2
            scored_all = scored_all + scored
        n = scored_all.sum(1)
        mse = err.sum(-1) / n.clamp_min(1.0)  # (4, clients)
        have = torch.tensor([True, True, pooled is not None, self.raw_coef is not None])
        simple = torch.where(have[1:].unsqueeze(1), mse[1:], math.inf)
        best = simple.argmin(0)  # (clients,) 0 own, 1 pooled, 2 raw
        d = err[0] - pick_err(err[1:], best)
        mean = (d * scored_all).sum(1) / n.clamp_min(1.0)
        var = ((d - mean.unsqueeze(1)) ** 2 * scored_all).sum(1) / (n - 1).clamp_min(1.0)
        base = pick_mse(mse[1:], best)
        bar = self.margin * base + self.z * (var / n.clamp_min(1.0)).sqrt()
        worse = (n >= MIN_SCORED) & (mean > bar)
        out["val_mse"] = torch.where(n > 0, mse[0], -1.0)
        if self.sigma == "scale":
            out = scale_sigma(out, err[0] * last, stated, last, ~worse)
        if bool(worse.any()):
            simple = (lin, self.raw_coef, pooled_lines(down, len(lin)))
            out = ship_simple(out, data, design, best, worse, base, *simple)
        return out

    # ---- server state, status and records -------------------------------------------------
    def init(self) -> Tree:
        """The choice's server state before any sums: no pooled line yet."""
        k, lin = self.candidates + len(SIMPLE), 1 + self.inputs
        zero = torch.tensor(0.0, dtype=F64)
        start = {
            "pooled_fold": torch.zeros(FOLDS, lin, dtype=F64),
            "pooled_all": torch.zeros(lin, dtype=F64),
            "pooled_ok": zero.clone(),
            "forward_scores": torch.zeros(k, dtype=F64),
            "forward_scored": zero.clone(),
        }
        if not self.forward.on:
            return start
        return {
            **start,
            "fwd_scale": torch.tensor(1.0, dtype=F64),
            "fwd_rate": zero.clone(),
            "fwd_declined": zero.clone(),
            "fwd_T": zero.clone(),
            "fwd_check": torch.full((3,), -1.0, dtype=F64),
        }

    def kept(self, server: Tree, forward: Tree | None) -> Tree:
        """The pooled lines and forward scores to keep (last round's without new sums)."""
        if "pooled_ok" not in server:
            return {}
        return {k: server[k] for k in CHOICE_KEYS if k in server} if forward is None else forward

    def unit_columns(self, params: Tree, train: ClientData | None = None) -> dict:
        """Per unit: ``fallback``, the model it ships (no harm; a code, named by
        :attr:`labels` where the tables are written), ``sigma_scale``, the factor its σ got
        from its own later rows (fedprior_forward.scale_sigma), and ``future_scale``, κ on
        σ after calibration (NaN: declined); ``train``: the hook's (core/hooks.UnitColumns),
        not read."""
        if "fallback" not in params or self.choose == "off":
            return {}
        out = {"fallback": params["fallback"].to(F64).numpy()}  # codes: labels
        if "sigma_scale" in params:
            out["sigma_scale"] = params["sigma_scale"].to(F64).numpy()
        if "fwd_scale" in params:  # κ on σ after calibration; NaN: declined (fedprior_forward)
            declined = params["fwd_declined"].to(F64) > 0
            out["future_scale"] = torch.where(declined, math.nan, params["fwd_scale"]).numpy()
        return out

    # ---- status ------------------------------------------------------------------------
    def status_values(
        self, model: UnitModel, personal: Tree, x: Tensor, mask: Tensor
    ) -> dict[str, Tensor]:
        """(clients,) each unit's validation RMSE and mean predictive σ at ``x`` (its test
        inputs, where its errors are measured), each over the unit's own target spread (the
        standard deviation of its calibration targets: a rain gauge of a wet site is not
        implausible for its larger errors); NaN where not measured."""
        if self.choose == "off":
            return {}
        n = x.shape[0]
        spread = personal.get("target_sd")
        spread = torch.ones(n, dtype=F64) if spread is None else spread.to(F64).reshape(n)
        spread = torch.where(spread > 0, spread, math.nan)
        out = {}
        if "val_mse" in personal:
            val = personal["val_mse"].to(F64).reshape(n)  # -1: not measured
            out["rmse"] = torch.where(val >= 0, val.clamp_min(0.0).sqrt() / spread, math.nan)
        std = model.predictive_std(personal, x)
        if std is not None:
            m = mask.to(F64)
            s = (std.to(F64)[..., 0] * m).sum(1) / m.sum(1).clamp_min(1.0) / spread
            out["sigma"] = torch.where(m.sum(1) > 0, s, math.nan)
        return out

    def implausible_units(
        self,
        model: UnitModel,
        personal: Tree,
        x: Tensor,
        mask: Tensor,
        medians: dict | None = None,
    ) -> Tensor:
        """(clients,) units whose :meth:`status_values` exceed ``implausible`` times the
        fleet's median (``medians``: over every unit of the fleet, as a chunked caller
        passes them; None: over these units, at least 3 measured; module doc)."""
        values = self.status_values(model, personal, x, mask)
        medians = fleet_medians(values) if medians is None else medians
        flag = torch.zeros(x.shape[0], dtype=torch.bool)
        for name, v in values.items():
            ref = medians.get(name)
            if ref is not None and bool(torch.isfinite(ref)):
                flag |= torch.isfinite(v) & (v > self.implausible * ref)
        return flag
