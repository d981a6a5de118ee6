"""The interval on the future, calibrated on each unit's own later rows, or declined (issue 34).

A unit's stated σ is right for its calibration period; it is used after it. The forward
folds of the time-respecting choice (:mod:`~fedcal.algorithms.fedprior_choice`: fit on a
unit's earlier rows, score its later ones) show how that σ fares on rows after the fit.
From federated sums of their coverage the fleet learns one variance for use after t_i, the
unit's last calibration time,

    V(x, t) = κ² · (v(x) + ρ · h · w(x)),   h = max(t − t_i, 0) / T,   w(x) = φ(x)ᵀ Σ φ(x),

v(x) the variance the unit states (at each row's time for fedprior_drift), Σ the fleet
prior's spread on the basis in use (φ guarded beyond the support box), T the fleet's time
scale (the mean calibration span, each span capped at 32 × the median:
:func:`~fedcal.algorithms.fedprior_choice_parts.fleet_time_scale`), ρ ≥ 0 a growth of the
variance with time since calibration in the directions the units differ in (a gain that
drifts errs most at high readings), κ a factor. Rows at or before t_i keep v(x).

**Uploads** (per unit i and fold k, on its n_ik scored rows whose early fit states a
finite variance v_r; e_r the early fit's error, h_r from the fold's last fit time; only
these sums leave a unit):

    c_ikjm = (1/n_ik) Σ_r 1[e_r² ≤ 1.96² κ_m² (v_r + ρ_j h_r w_r)]        ∈ [0, 1]
    a_ikj  = min((1/n_ik) Σ_r log(1 + ρ_j h_r w_r / v_r), A_CLIP)          ∈ [0, A_CLIP]
    b_ikj  = (1/n_ik) Σ_r min(e_r² / (v_r + ρ_j h_r w_r), Z2_CLIP)         ∈ [0, Z2_CLIP]
    u_ik   = 1 if the unit has such rows in fold k, else 0 (and c, a, b are 0),

for ρ_j of :data:`RATES` and κ_m of :data:`SCALES`, with c² beside c (the spread for the
test below). Every term is a per-row mean, so each unit weighs one, as the target (the mean
over units of their coverage) does; bounded, so one unit moves a fleet mean by ≤ 1/N of
its range (the server clips and checks them: :func:`forward_problems`).

**Fit** (server, :func:`forward_fit`). C_kjm = Σ_i c_ikjm / N_k (N_k = Σ_i u_ik) is fold
k's mean coverage. For each ρ_j, κ_j is the smallest κ_m with C_kjm ≥ 0.95 in *every*
fold (the future is another period; a factor that covered only their average covered the
worse one below 95 %); ρ is the ρ_j of the best mean log score at (ρ_j, κ_j),

    S_j = Σ_k (1/N_k) Σ_i −[log κ_j + ½ a_ikj + ½ b_ikj / κ_j²]   (+ terms free of j),

a proper score, so ρ follows how the errors grow, not only how many rows are covered.

**Declined** (no interval after t_i, every unit; the reason in prior.json
``selection.forward.interval`` and the run's note), when the fleet's own forward validation
shows it cannot be trusted:

* too few units scored: N_k < :data:`MIN_UNITS` in a fold;
* no κ ≤ max :data:`SCALES` covers 95 % of every fold;
* it does not carry over in time: (ρ₀, κ₀) fitted on fold 0 alone (the earlier period)
  covers fold 1 at C₁ outside [0.90, 0.97] by more than 2 standard errors of the mean over
  its units, SE² = (Σ_i c_i² / N₁ − C₁²) / (N₁ − 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from fedcal.algorithms.fedprior_basis import model_mask
from fedcal.algorithms.fedprior_choice_parts import row_times, subset
from fedcal.algorithms.fedprior_support import SupportBox
from fedcal.core.bayes import F64
from fedcal.core.data import ClientData
from fedcal.core.hooks import TimedStd
from fedcal.core.tree import Tree

#: ρ: variance growth per fleet time scale, in units of φᵀΣφ (0, then 4 per decade)
RATES = torch.cat([torch.zeros(1, dtype=F64), torch.logspace(-3, 1, 17, dtype=F64)])
#: κ: factors on σ, 0.5 … 4 in steps of 4.5 %
SCALES = torch.exp(torch.linspace(math.log(0.5), math.log(4.0), 48, dtype=F64))
TARGET = 0.95
BAND = (0.90, 0.97)  # where the carried-over factor's coverage of the later fold must lie
MIN_UNITS = 3
A_CLIP = 10.0  # nats: the mean log variance ratio a unit may add for a ρ
Z2_CLIP = 100.0  # a row's standardized squared error counts at most this (10 σ)
SIGMA_PRIOR_ROWS = 20.0  # pseudo-rows at ratio 1 of a unit's own σ scale (scale_sigma)
FORWARD_KEYS = ("fwd_scale", "fwd_rate", "fwd_declined", "fwd_T")
Z95 = 1.959964


def fold_terms(e: Tensor, v: Tensor, hw: Tensor, scored: Tensor) -> dict[str, Tensor]:
    """One fold's uploads of every unit (module doc): ``e``, ``v``, ``hw`` = h·w, ``scored``
    (clients, rows); rows with a non-finite or non-positive ``v`` are not counted."""
    ok = (scored > 0) & torch.isfinite(v) & (v > 0) & torch.isfinite(e) & torch.isfinite(hw)
    n = ok.sum(1).to(F64)
    v = torch.where(ok, v, 1.0)
    e2 = torch.where(ok, e * e, 0.0)
    hw = torch.where(ok, hw.clamp_min(0.0), 0.0)
    var = v.unsqueeze(-1) + hw.unsqueeze(-1) * RATES  # (c, r, J)
    need = (e2.unsqueeze(-1) / (Z95 * Z95 * var)).sqrt()  # the κ that row needs, per ρ
    bucket = torch.bucketize(need, SCALES)  # rows covered at κ_m: bucket ≤ m
    m = len(SCALES)
    counts = torch.zeros(*var.shape[:1], len(RATES), m + 1, dtype=F64)
    w = ok.to(F64).unsqueeze(-1).expand_as(need)
    counts.scatter_add_(2, bucket.transpose(1, 2), w.transpose(1, 2))
    denom = n.clamp_min(1.0).reshape(-1, 1, 1)
    cover = counts[..., :m].cumsum(-1) / denom
    okf = ok.to(F64).unsqueeze(-1)
    a = (torch.log1p(hw.unsqueeze(-1) * RATES / v.unsqueeze(-1)) * okf).sum(1)
    b = ((e2.unsqueeze(-1) / var).clamp_max(Z2_CLIP) * okf).sum(1)
    unit = (n > 0).to(F64)
    return {
        "cover": cover * unit.reshape(-1, 1, 1),
        "cover_sq": (cover * cover) * unit.reshape(-1, 1, 1),
        "logv": (a / denom[..., 0]).clamp(0.0, A_CLIP),
        "z2": b / denom[..., 0],
        "units": unit,
    }


def bound_terms(up: dict[str, Tensor]) -> dict[str, Tensor]:
    """Each unit's forward uploads clipped to their ranges (non-finite entries 0): what the
    server sums when it sees units one by one (the checks refuse such replies)."""
    out = {k: torch.nan_to_num(v.to(F64), nan=0.0, posinf=0.0, neginf=0.0) for k, v in up.items()}
    unit = out["units"].clamp(0.0, 1.0)
    out["units"] = unit
    top = unit.reshape(*unit.shape, *([1] * (out["cover"].dim() - unit.dim())))
    out["cover"] = torch.minimum(out["cover"].clamp(0.0, 1.0), top)
    out["cover_sq"] = torch.minimum(out["cover_sq"].clamp(0.0, 1.0), top)
    out["logv"] = out["logv"].clamp(0.0, A_CLIP)
    out["z2"] = out["z2"].clamp(0.0, Z2_CLIP)
    return out


def _scale_per_rate(cover: Tensor) -> Tensor:
    """(J,) index of the smallest κ_m with every fold's mean coverage ≥ 95 % (−1: none);
    ``cover``: (folds, J, M) fleet means."""
    ok = (cover >= TARGET).all(0)  # (J, M)
    first = torch.argmax(ok.to(torch.int8), dim=-1)
    return torch.where(ok.any(-1), first, -1)


def _best(cover: Tensor, logv: Tensor, z2: Tensor) -> tuple[int, int] | None:
    """(j, m) of the best log score among the ρ_j with a covering κ (module doc, Fit)."""
    m_idx = _scale_per_rate(cover)
    if not bool((m_idx >= 0).any()):
        return None
    kappa = SCALES[m_idx.clamp_min(0)]  # (J,)
    score = -(torch.log(kappa) + 0.5 * logv + 0.5 * z2 / kappa**2).sum(0)  # (J,) over folds
    score = torch.where(m_idx >= 0, score, -math.inf)
    j = int(torch.argmax(score))  # ties: the smaller ρ
    return j, int(m_idx[j])


def forward_fit(total: dict[str, Tensor], time_scale: Tensor) -> dict[str, Tensor]:
    """The fleet's (κ, ρ/T) for use after calibration, or declined (module doc, Fit and
    Declined). ``total``: the units' summed uploads, each (folds, …)."""
    units = total["units"]  # (folds,)
    n = units.clamp_min(1.0)
    cover = total["cover"] / n.reshape(-1, 1, 1)
    logv, z2 = total["logv"] / n.reshape(-1, 1), total["z2"] / n.reshape(-1, 1)
    out = {
        "fwd_scale": torch.tensor(1.0, dtype=F64),
        "fwd_rate": torch.tensor(0.0, dtype=F64),
        "fwd_declined": torch.tensor(0.0, dtype=F64),
        "fwd_T": time_scale.to(F64).reshape(()),
        "fwd_check": torch.full((3,), -1.0, dtype=F64),  # not measured
    }
    if bool((units < MIN_UNITS).any()):
        out["fwd_declined"] = torch.tensor(1.0, dtype=F64)
        return out
    best = _best(cover, logv, z2)
    if best is None:
        out["fwd_declined"] = torch.tensor(2.0, dtype=F64)
        return out
    j, m = best
    out["fwd_scale"] = SCALES[m].clone()
    t = float(time_scale)
    out["fwd_rate"] = RATES[j] / t if t > 0 else torch.tensor(0.0, dtype=F64)
    early = _best(cover[:1], logv[:1], z2[:1])  # fold 0 alone: does it carry over to fold 1?
    if early is not None and cover.shape[0] > 1:
        j0, m0 = early
        c1 = cover[1, j0, m0]
        mean_sq = total["cover_sq"][1, j0, m0] / n[1]
        se = ((mean_sq - c1 * c1).clamp_min(0.0) / (n[1] - 1).clamp_min(1.0)).sqrt()
        out["fwd_check"] = torch.stack([c1, se, SCALES[m0]]).to(F64)
        off = (c1 - c1.clamp(*BAND)).abs()
        if bool(off > 2 * se):
            out["fwd_declined"] = torch.tensor(3.0, dtype=F64)
    return out


def forward_reason(server: dict[str, Tensor]) -> str:
    """Why the interval after calibration is declined ("" when it is stated)."""
    code = int(float(server["fwd_declined"]))
    if code == 1:
        return f"fewer than {MIN_UNITS} units scored on their later rows in a forward fold"
    if code == 2:
        return f"no factor up to {float(SCALES[-1]):.1f} on σ covers 95 % of every forward fold"
    if code == 3:
        c1, se, k0 = (float(v) for v in server["fwd_check"])
        return (
            f"the factor learned on the earlier forward fold (κ {k0:.2f}) covers {c1:.3f} of "
            f"the later one (SE {se:.3f}), outside {BAND[0]:.2f}–{BAND[1]:.2f}: the coverage "
            "changes between periods beyond chance"
        )
    return ""


def forward_record(server: dict[str, Tensor]) -> dict[str, Any]:
    """prior.json's record of the interval after calibration."""
    c1, se, k0 = (float(v) for v in server["fwd_check"])
    record: dict[str, Any] = {
        "model": "V(x, t) = κ²(v(x) + ρ·max(t − t_i, 0)/T·φᵀΣφ) after the unit's last "
        "calibration time t_i",
        "kappa": float(server["fwd_scale"]),
        "rate_per_time": float(server["fwd_rate"]),
        "time_scale": float(server["fwd_T"]),
        "carried_over": None if c1 < 0 else {"coverage": c1, "se": se, "kappa": k0},
    }
    reason = forward_reason(server)
    if reason:
        record["declined"] = reason
    return record


def forward_var(params: dict[str, Tensor], time: Tensor, var: Tensor, w: Tensor) -> Tensor:
    """(clients, rows) the variance after calibration (module doc): κ²(v + (ρ/T)(t − t_i) w)
    for rows after t_i, v before; NaN after t_i where the fleet declined."""
    t_ref = params["fwd_t"].to(F64).unsqueeze(1)
    dt = (time.to(F64) - t_ref).clamp_min(0.0)
    after = time.to(F64) > t_ref
    k2 = params["fwd_scale"].to(F64).unsqueeze(1) ** 2
    grown = k2 * (var + params["fwd_rate"].to(F64).unsqueeze(1) * dt * w)
    declined = (params["fwd_declined"].to(F64) > 0).unsqueeze(1)
    grown = torch.where(declined, math.nan, grown)
    return torch.where(after, grown, var)


def forward_problems(sub: dict[str, Tensor]) -> dict[int, str]:
    """{row of ``sub``: why} for units whose forward uploads (``choice/fwd_*``) are not what
    rows can give: non-finite; ``units`` not 0 or 1; coverage outside [0, units] or falling
    as κ grows; c² not the square of c; the mean log ratio outside [0, A_CLIP]; the mean
    standardized squared error outside [0, Z2_CLIP]."""
    keys = ("cover", "cover_sq", "logv", "z2", "units")
    up = {k: sub[f"choice/fwd_{k}"].to(F64) for k in keys}
    c = up["units"].shape[0]
    tol = 1e-9
    whys: dict[int, str] = {}
    finite = torch.stack([torch.isfinite(v.reshape(c, -1)).all(1) for v in up.values()]).all(0)
    for j in (~finite).nonzero()[:, 0].tolist():
        whys[j] = "forward interval uploads not finite"
    unit = up["units"]  # (c, folds)
    cover = up["cover"]  # (c, folds, J, M)
    shape = unit.reshape(*unit.shape, 1, 1)
    bad = ~((unit == 0) | (unit == 1)).all(1)
    bad |= ~((cover >= -tol) & (cover <= shape + tol)).reshape(c, -1).all(1)
    bad |= ~(cover.diff(dim=-1) >= -tol).reshape(c, -1).all(1)
    bad |= ~((up["cover_sq"] - cover * cover).abs() <= tol).reshape(c, -1).all(1)
    bad |= ~((up["logv"] >= -tol) & (up["logv"] <= A_CLIP * (1 + tol))).reshape(c, -1).all(1)
    bad |= ~((up["z2"] >= -tol) & (up["z2"] <= Z2_CLIP * (1 + tol))).reshape(c, -1).all(1)
    for j in (bad & finite).nonzero()[:, 0].tolist():
        whys.setdefault(
            j,
            "forward interval uploads outside what rows give (coverage in [0, 1], "
            "rising in κ; bounded scores)",
        )
    return whys


class UnitModel(Protocol):
    """What the forward folds and the no-harm test read of the model they score (FedPrior,
    fedprior_drift): a unit's posterior model from some of its rows, its prediction and its
    stated σ (at each row's time where the model has one: :class:`~fedcal.core.hooks.TimedStd`)."""

    def _personal(self, down: Tree, state: Tree, data: ClientData) -> Tree: ...

    def predict(self, params: Tree, x: Tensor) -> Tensor: ...

    def predictive_std(self, params: Tree, x: Tensor) -> Tensor | None: ...


def stated_var(model: UnitModel, params: Tree, data: ClientData) -> Tensor:
    """(clients, rows) the predictive variance ``params`` states at ``data``'s rows (at
    each row's time for a model with one, fedprior_drift's); NaN where it states none."""
    if isinstance(model, TimedStd):
        std = model.predictive_std_timed(params, data)
    else:
        std = model.predictive_std(params, data.x)
    if std is None:
        return torch.full(data.mask.shape, math.nan, dtype=F64)
    return std.to(F64)[..., 0] ** 2


@dataclass(frozen=True)
class ForwardInterval:
    """The interval after calibration (module doc): uploads, fit and use; a part of
    :class:`~fedcal.algorithms.fedprior_choice.TimeChoice` (its ``forward``), declared by
    ``choice_interval`` ("forward" or "off"), φ's terms and the support box that guards φ."""

    interval: str  # "forward": σ after calibration from the forward folds; "off": none
    terms: tuple[tuple[int, ...], ...]
    support_box: SupportBox

    #: the broadcast keys of the time-respecting choice (fedprior's broadcast)
    broadcast_keys = ("pooled_fold", "pooled_all", "pooled_ok", *FORWARD_KEYS)

    @property
    def on(self) -> bool:
        return self.interval == "forward"

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The per-unit keys :meth:`personal` adds (fedprior's personal_shapes)."""
        if not self.on:
            return {}
        p = len(self.terms)
        shape = {"fwd_scale": (), "fwd_rate": (), "fwd_declined": (), "fwd_t": ()}
        return {**shape, "fwd_cov": (p, p)}

    def spread_w(self, params: Tree, x: Tensor, sigma: Tensor) -> Tensor:
        """(clients, rows) w(x) = φ(x)ᵀΣφ(x), φ guarded by ``params``' box, Σ on φ's terms."""
        p = len(self.terms)
        phi, _ = self.support_box.guarded(params, x.to(F64))
        return ((phi @ sigma.to(F64)[..., :p, :p]) * phi).sum(-1)

    def fleet_spread(self, down: Tree) -> Tensor:
        """(clients, p, p) the broadcast Σ on the model's terms of φ."""
        p = len(self.terms)
        sigma = down["sigma"].to(F64)
        mask = model_mask(down)
        if mask is not None:
            mask = mask.to(F64).reshape(-1, sigma.shape[-1])
            sigma = sigma * mask.unsqueeze(-1) * mask.unsqueeze(-2)
        return sigma[..., :p, :p]

    def fold(
        self,
        model: UnitModel,
        down: Tree,
        state: Tree,
        data: ClientData,
        fit: Tensor,
        scored: Tensor,
    ) -> dict[str, Tensor]:
        """One fold's forward uploads (module doc): the unit's fit on its ``fit`` rows states
        v_r at its ``scored`` rows; h_r from the fit's last time, in the broadcast T."""
        early = model._personal(down, state, subset(data, fit))
        y = data.y[..., 0].to(F64)
        e = model.predict(early, data.x.to(F64))[..., 0].to(F64) - y
        v = stated_var(model, early, data)
        t = row_times(data)
        t_fit = torch.where(fit > 0, t, -math.inf).amax(1, keepdim=True)
        scale = float(down.get("fwd_T", torch.zeros(1)).reshape(-1)[0])
        h = ((t - t_fit).clamp_min(0.0) / scale) if scale > 0 else torch.zeros_like(t)
        h = torch.where(torch.isfinite(h), h, 0.0)
        hw = h * self.spread_w(early, data.x, self.fleet_spread(down))
        return fold_terms(e, v, hw, scored)

    def personal(self, down: Tree, data: ClientData, out: Tree) -> Tree:
        """The unit's keys for use after calibration: the fleet's κ, ρ/T and decline, its
        last calibration time and Σ (no forward fit broadcast: κ = 1, ρ = 0)."""
        c = data.num_clients

        def fleet(key: str, default: float) -> Tensor:
            v = down.get(key)
            v = default if v is None else float(v.to(F64).reshape(-1)[0])
            return torch.full((c,), v, dtype=F64)

        t = row_times(data)
        real = data.mask > 0
        last = torch.where(real, t, -math.inf).amax(1)
        out["fwd_t"] = torch.where(real.any(1), last, 0.0)
        out["fwd_scale"] = fleet("fwd_scale", 1.0)
        out["fwd_rate"] = fleet("fwd_rate", 0.0)
        out["fwd_declined"] = fleet("fwd_declined", 0.0)
        out["fwd_cov"] = self.fleet_spread(down).expand(c, -1, -1).contiguous().clone()
        return out

    def std(self, params: Tree, data: ClientData, std: Tensor | None) -> Tensor | None:
        """σ at each row's time after calibration (:func:`forward_var`); ``std`` unchanged
        without a time column or a forward fit in ``params``."""
        if std is None or data.time is None or "fwd_scale" not in params:
            return std
        w = self.spread_w(params, data.x, params["fwd_cov"])
        var = forward_var(params, data.time, std.to(F64)[..., 0] ** 2, w)
        return var.sqrt().unsqueeze(-1).to(std.dtype)


def scale_sigma(out: Tree, sq_err: Tensor, stated: Tensor, scored: Tensor, which: Tensor) -> Tree:
    """Each unit's variance scaled so that its fit on all but the last h of its span
    would have covered 95 % of that last h (the fold most like use): with z_r = |e_r| /
    √v_r on the scored rows (e the error, v the variance that fit stated there) and q
    their 95 % quantile, r = (q / 1.96)², shrunk to 1 by ``SIGMA_PRIOR_ROWS``
    pseudo-rows, r̃ = (n r + n₀) / (n + n₀). A quantile, not Σe²/Σv: hourly PM errors are
    heavy-tailed, and the mean-square ratio over-covered (Antwerp 0.986, docs/field.md).
    The posterior covariance, every ``*_var`` of the unit and fedprior_drift's walk
    covariance times r̃ (its σ times √r̃, at every time)."""
    ok = torch.isfinite(stated) | (scored == 0)
    v = torch.where(scored > 0, torch.nan_to_num(stated, nan=0.0), 0.0)
    n = scored.sum(1)
    z = torch.where((scored > 0) & (v > 0), (sq_err / v.clamp_min(1e-300)).sqrt(), math.nan)
    q = torch.nanquantile(z, 0.95, dim=1)
    ratio = (n * (q / 1.959964) ** 2 + SIGMA_PRIOR_ROWS) / (n + SIGMA_PRIOR_ROWS)
    mean_v = v.sum(1) / n.clamp_min(1.0)
    use = which & ok.all(1) & (n > 0) & (mean_v > 0) & torch.isfinite(ratio)
    r = torch.where(use, ratio, 1.0)
    out["cov"] = out["cov"].to(F64) * r.reshape(-1, 1, 1)
    if "drift_cov" in out:  # fedprior_drift: the walk's growth after t_i too
        out["drift_cov"] = out["drift_cov"].to(F64) * r.reshape(-1, 1, 1)
    for key in [k for k in out if k.endswith("_var")]:
        if tuple(out[key].shape) == tuple(r.shape):
            out[key] = out[key].to(F64) * r
    out["sigma_scale"] = r.sqrt()
    return out
