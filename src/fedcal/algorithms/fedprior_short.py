"""Short co-locations: how much a unit calibrated over a short time borrows (issue 26).

A unit co-located with the reference for a few weeks saw one season; in use it meets the
others. Its own points determine its coefficients *within* that season, and the
hierarchical posterior trusts them there as it would trust the same number of points spread
over a year: the slope of a seasonal covariate (humidity, temperature) fitted inside one
season extrapolates badly to the next, and no check inside the unit can see it (its own
held-out rows lie in the same season). The fleet can: its units with long co-locations
emulate a short one and measure what it costs. Steps (``short_colocation = "holdout"``, with
a time column):

S1. **The short design.** Round 0 sets the fleet's short window s, the smallest calibration
    span any unit declared (the spans fedprior_drift's time scale already adds). The *short
    class* is every unit whose span is below 2s; a unit with a span of at least 2s is
    *long*.
S2. **Emulation, each long unit.** Its future period is the last ``drift_holdout`` (25 %)
    of its calibration span (as the drift's future check). It places ``SHORT_WINDOWS``
    windows of length s evenly between its first row and the start of that period (the
    last window ends where it starts); from each window's rows alone, under the
    broadcast prior, it forms the posterior with its data's weight tempered by w for each w
    of :data:`TEMPER_GRID` (moments w·G, w·b: w = 1 the unit's posterior, w = 0 the fleet's
    relation μ), and predicts every row r of its future period as it would in use: mean
    φ_rᵀm_w, variance v = σ² [+ τ²] + φ_rᵀV_wφ_r + ((q + q_s)/T)(t_r − t_w)φ_rᵀΣ_dφ_r,
    t_w the window's end, τ² the probe's (I2) when the window holds fewer than twice its
    rows (as in use), q the fleet's walk and q_s ≥ 0 an extra rate of the short class: what
    a short co-location's relation loses with time — the seasons it did not see — grows
    with the time since it, as a walk's. It uploads, per w, the summed squared error; per w and
    q_s of :data:`~fedcal.algorithms.fedprior_drift_walk.DRIFT_GRID`, the summed log density
    log N(y_r; φ_rᵀm_w, v); at the broadcast (w*, q_s*), per τ² of
    :data:`~fedcal.algorithms.fedprior_interval.TAU_GRID`, how many rows lie within
    ±1.96 √(v + τ²); and how many rows it held out (sums only). Other designs
    (``short_emulation``): ``"span"``, windows evenly over the whole span, every row outside
    a window predicted (before it too, at |t − window|); ``"far"``, the first window only
    (the one farthest from the future period). On the 8-feature field network neither
    matched the short units' errors better (docs/field.md, "Sixth session").
S3. **Server.** w* minimizes the fleet's summed squared error — the sum over units of each
    unit's (clipped) gain over w = 1, sse_i(w) − sse_i(1) (ties: the larger w, the unit's
    own data); q_s* maximizes the summed log density at w* — the sum of each unit's
    (clipped) gain over q_s = 0 — if it beats q_s = 0 by ½ ``drift_test`` nats (else 0);
    τ²_s is the smallest τ² whose pooled coverage reaches ``coverage_target`` (linear
    between grid values; none: NaN), at the (w*, q_s*) of the
    round before (one round behind, as the uploads are formed at the broadcast). No long
    unit: w* = 1, q_s* = 0, τ²_s = 0: the short class is fedprior_drift's as before.
S4. **Use, each unit of the short class.** Its posterior is formed with weight w* on its
    own rows (the same tempering as S2); its σ grows after t_i at the rate (q + q_s*)/T (its
    ``recalibrate_at`` follows) and its interval adds τ²_s to what it states otherwise (the
    probe's τ² matches designs in input space, not in time); with τ²_s NaN it states no
    interval. Long units are unchanged.

w is the fleet's answer to "as much as its data warrant": learned from future periods of
units that have them, never tuned to a generator. A unit whose short window happens to span
the seasons it is used in loses little at w* < 1 (the fleet relation is close there too).
Hostile sites: the squared errors, scores and counts are not checked against the unit's
statistics (the server cannot recompute them without the held-out rows). Each unit's held-out
count is clipped to its declared rows, its counts to that, its score gains over q_s = 0 to
± ``drift_score_clip`` per row (as the drift's future scores), and its squared errors' gains
over w = 1 to ± ``short_sse_clip`` (20) × its held-out rows × a typical unit's squared error
per row at that w (:func:`~fedcal.algorithms.fedprior_drift_checks.bound_short_sse`); the server
sums only these clipped gains, never a unit's squared error at w = 1 or score at q_s = 0
themselves (unbounded: a forged huge common offset would swallow the honest margins in
float64 and tie every column), and non-finite uploads are rejected
(:func:`~fedcal.algorithms.fedprior_drift_checks.drift_problems`). So one forging unit moves the
fleet's preference between two w, w' by at most 20 · h_i · (s_w + s_w'), and w* only where
the honest fleet's margin is smaller than that; q_s* likewise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fedcal.algorithms.fedprior_basis import DesignBasis, model_mask, unit_noise
from fedcal.algorithms.fedprior_interval import TAU_GRID, CalibratedInterval
from fedcal.algorithms.fedprior_select import _masked
from fedcal.core.bayes import F64, Moments, count_within, moments, posterior
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree

# w: the weight of a short unit's own rows in its posterior, 0 (the fleet's relation) to 1.
TEMPER_GRID = torch.tensor([0.0, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0], dtype=F64)
SHORT_WINDOWS = 4  # windows a long unit emulates (S2), evenly over its span
Z95 = 1.959964


def unit_times(data: ClientData) -> Tensor:
    """Each row's time; without a time column every row at 0 (no span: q stays 0)."""
    if data.time is None:
        return torch.zeros(data.mask.shape, dtype=F64)
    return data.time.to(F64)


def unit_span(t: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(t_i, span_i): each unit's latest row time and its calibration span (clients,)."""
    real = mask > 0
    last = torch.where(real, t, -math.inf).amax(1)
    first = torch.where(real, t, math.inf).amin(1)
    ok = real.any(1)
    return torch.where(ok, last, 0.0), torch.where(ok, last - first, 0.0)


@dataclass(frozen=True)
class ShortColocation:
    """Steps S1–S4 (module doc); a part of
    :class:`~fedcal.algorithms.fedprior_drift.FedPriorDrift` (its ``short``), declared by the
    settings it reads (``short_colocation``, ``short_emulation``, ``drift_holdout``,
    ``drift_test``, ``noise``), the design basis, the calibrated interval (its τ² rule) and
    the drift's grid of q; the drift's Σ_d is passed to :meth:`holdout`."""

    colocation: str  # short_colocation: "holdout" or "off"
    emulation: str  # short_emulation: "future", "span" or "far"
    drift_holdout: float  # a long unit's future period, a share of its span
    drift_test: float  # 2Δ log-evidence a q_s > 0 must gain
    noise: str  # "fleet" or "sensor" (fedprior_basis.unit_noise)
    basis: DesignBasis
    calibrated: CalibratedInterval
    q_grid: Tensor = field(compare=False, repr=False)  # fedprior_drift_walk's DRIFT_GRID

    def init(self) -> Tree:
        """The short step's server state before any sums (S1 not yet known)."""
        zero = torch.tensor(0.0, dtype=F64)
        return {
            "window": zero.clone(),  # s (time units); 0: not known yet, or no short class
            "temper": torch.tensor(1.0, dtype=F64),  # w*
            "q": zero.clone(),  # q_s* (per T, like q)
            "tau": zero.clone(),  # τ²_s (NaN: none covered)
            "held": zero.clone(),  # rows the long units held out (0: S3 off)
            "sse": torch.zeros(len(TEMPER_GRID), dtype=F64),
            "score": torch.zeros(len(TEMPER_GRID), len(self.q_grid), dtype=F64),
        }

    def broadcast(self, drift: Tree) -> Tree:
        """What a unit needs of S1–S3: nothing before the fleet learned it (a prior read
        back from prior.json without it)."""
        if "short" not in drift:
            return {}
        keys = ("window", "temper", "q", "tau", "held")
        return {"short": {k: drift["short"][k] for k in keys}}

    def short_class(self, down: Tree, data: ClientData) -> Tensor:
        """(clients,) bool: units of the short class under a learned S3 (S1, S4)."""
        short = down["drift"].get("short")
        # without row times (``fedcal calibrate`` with no time column) a unit's span is
        # unknown, not short: every span would read 0 and every unit join the class
        if short is None or self.colocation == "off" or data.time is None:
            return torch.zeros(data.num_clients, dtype=torch.bool)
        window = short["window"].to(F64).reshape(-1)[0]
        held = short["held"].to(F64).reshape(-1)[0]
        _, span = unit_span(unit_times(data), data.mask.to(F64))
        return (span < 2 * window) & (window > 0) & (held > 0)

    def holdout(
        self, down: Tree, state: Tree, data: ClientData, drift_cov: Tensor | None = None
    ) -> Tree:
        """A long unit's emulation of a short co-location (S2): its uploads; ``drift_cov``:
        the broadcast Σ_d on the drifting coordinates (fedprior_drift; None: the zeros of a
        round before the fleet's time scale is known)."""
        grid = self.q_grid
        c, w_n, q_n, k = data.num_clients, len(TEMPER_GRID), len(grid), len(TAU_GRID)
        out = {
            "sse": torch.zeros(c, w_n, dtype=F64),
            "score": torch.zeros(c, w_n, q_n, dtype=F64),
            "inside": torch.zeros(c, k, dtype=F64),
            "held": torch.zeros(c, dtype=F64),
        }
        short = down["drift"].get("short")
        if short is None or self.colocation == "off" or drift_cov is None:
            return out
        window = float(short["window"].reshape(-1)[0])
        if not window > 0:
            return out
        t, mask = unit_times(data), data.mask.to(F64)
        t_last, span = unit_span(t, mask)
        first = t_last - span
        long = span >= 2 * window
        if not bool(long.any()):
            return out
        y = data.y[..., 0].to(F64)
        design = self.basis.design(data.x, data.branch).to(F64)
        model = model_mask(down)
        if model is not None:
            design = design * model.to(F64).reshape(-1, design.shape[-1]).unsqueeze(1)
        noise = unit_noise(self.noise, down, state).to(F64).reshape(-1).expand(c)
        scale = down["drift"]["scale"].to(F64).reshape(-1)[0]
        walk = ((design @ drift_cov) * design).sum(-1) / scale  # φᵀΣ_dφ/T
        mu = down["mu"].to(F64).repeat_interleave(w_n, 0)
        sigma = down["sigma"].to(F64).repeat_interleave(w_n, 0)
        now = int(torch.argmin((TEMPER_GRID - short["temper"].to(F64).reshape(-1)[0]).abs()))
        q_fleet = down["drift"]["q"].to(F64).reshape(-1)[0]  # every unit's walk (q_s: extra)
        q_now = short["q"].to(F64).reshape(-1)[0]
        probe = down.get("probe_n")
        probe = torch.tensor(0.0, dtype=F64) if probe is None else probe.to(F64).reshape(-1)[0]
        tau_probe = down.get("disc_var")
        tau_probe = 0.0 if tau_probe is None else tau_probe.to(F64).reshape(-1)[0]
        if self.emulation == "span":
            # S2: windows over the whole span, every other row predicted (before or after)
            future = torch.ones_like(mask)
            room = (span - window).clamp_min(0.0)
        else:  # "future"/"far": the last drift_holdout of the span, after each window only
            future = (t > (t_last - self.drift_holdout * span).unsqueeze(1)).to(F64)
            room = (span * (1 - self.drift_holdout) - window).clamp_min(0.0)
        for j in range(1 if self.emulation == "far" else SHORT_WINDOWS):
            start = first + room * j / (SHORT_WINDOWS - 1)
            end = start + window
            inside_w = (t >= start.unsqueeze(1)) & (t <= end.unsqueeze(1))
            keep = mask * inside_w.to(F64) * long.to(F64).unsqueeze(1)
            beyond = (t > end.unsqueeze(1)) | (t < start.unsqueeze(1))
            if self.emulation != "span":
                beyond = t > end.unsqueeze(1)
            held = mask * future * beyond.to(F64) * long.to(F64).unsqueeze(1)
            # a window of fewer than twice the probe's rows states the probe's τ² in use (I3)
            small = (keep.sum(1) < 2 * probe).to(F64) * (probe > 0).to(F64)
            pred, spread = _tempered(design, y, keep, model, mu, sigma, noise)
            base_var = (noise + small * tau_probe).reshape(-1, 1, 1) + spread  # (c, W, rows)
            # time from the window to the row, either side (a walk's variance is |Δt|)
            dt = (t - end.unsqueeze(1)).clamp_min(0.0) + (start.unsqueeze(1) - t).clamp_min(0.0)
            aged = dt * walk  # (c, rows): × (q + q_s)
            base_var = base_var + q_fleet * aged.unsqueeze(1)
            err2 = (y.unsqueeze(1) - pred) ** 2
            out["sse"] += (err2 * held.unsqueeze(1)).sum(-1)
            for qi in range(q_n):
                var = base_var + grid[qi] * aged.unsqueeze(1)
                logp = -0.5 * (torch.log(2 * math.pi * var) + err2 / var)
                out["score"][:, :, qi] += (logp * held.unsqueeze(1)).sum(-1)
            var_now = base_var[:, now] + q_now * aged
            out["inside"] += count_within(err2[:, now], var_now, TAU_GRID, held, Z95)
            out["held"] += held.sum(1)
        return out

    def update(self, old: Tree, span: Tensor, sums: Tree, weights: Tensor) -> Tree:
        """S1 (the window, fixed once set) and S3 (w*, q_s*, τ²_s) from the round's sums;
        ``sums`` per unit in the canonical order (``sse``, ``score``: each unit's clipped
        gains over w = 1 and q_s = 0, fedprior_drift's bound_short_sse and
        bound_future_scores), ``weights`` (clients,) their robust weights (1: none)."""
        new = {k: v.clone() for k, v in old.items()}
        if not float(old["window"]) > 0:
            positive = span[span > 0]
            if len(positive):
                new["window"] = positive.min().to(F64)
            return new
        sse = (sums["sse"] * weights.unsqueeze(1)).sum(0)
        score = (sums["score"] * weights.reshape(-1, 1, 1)).sum(0)
        inside = (sums["inside"] * weights.unsqueeze(1)).sum(0)
        held = (sums["held"] * weights).sum(0)
        new["sse"], new["score"], new["held"] = sse, score, held
        if not float(held) > 0:
            new["temper"] = torch.tensor(1.0, dtype=F64)
            new["q"], new["tau"] = torch.tensor(0.0, dtype=F64), torch.tensor(0.0, dtype=F64)
            return new
        flipped = torch.flip(sse, [0])  # ties: the larger w (argmin takes the first)
        best = len(TEMPER_GRID) - 1 - int(torch.argmin(flipped))
        new["temper"] = TEMPER_GRID[best].clone()
        k = int(torch.argmax(score[best]))  # ties: the smaller q_s
        beats = float(score[best, k] - score[best, 0]) > 0.5 * self.drift_test
        new["q"] = self.q_grid[k].clone() if beats else torch.tensor(0.0, dtype=F64)
        new["tau"] = self.calibrated.tau_of(inside / held)
        return new

    def personal_moments(self, down: Tree, data: ClientData, full: Moments) -> Moments:
        """S4: the short class's moments with weight w* (the others' unchanged)."""
        short = self.short_class(down, data)
        if not bool(short.any()):
            return full
        w = torch.where(short, down["drift"]["short"]["temper"].to(F64).reshape(-1)[0], 1.0)
        return Moments(
            full.gram * w.reshape(-1, 1, 1), full.rhs * w.unsqueeze(1), full.yy * w, full.n
        )

    def use(self, down: Tree, data: ClientData, out: Tree) -> Tree:
        """S4: the short class's walk rate (q + q_s*)/T, and τ²_s added to the probe's τ²;
        τ²_s NaN: no interval."""
        short = self.short_class(down, data)
        if not bool(short.any()):
            return out
        sh = down["drift"]["short"]
        scale = down["drift"]["scale"].to(F64).reshape(-1)[0]
        rate = (down["drift"]["q"].to(F64).reshape(-1)[0] + sh["q"].to(F64).reshape(-1)[0]) / scale
        if "drift_rate" in out:
            out["drift_rate"] = torch.where(short, rate, out["drift_rate"])
        if "disc_var" not in out:
            return out
        tau = sh["tau"].to(F64).reshape(-1)[0]
        out["disc_var"] = out["disc_var"] + torch.where(short, torch.nan_to_num(tau, nan=0.0), 0.0)
        # declined for a short unit also when no τ²_s covered
        if math.isnan(float(tau)):
            out["declined"] = torch.where(short, 1.0, out["declined"].to(F64))
        return out


def _tempered(
    design: Tensor,
    y: Tensor,
    keep: Tensor,
    model: Tensor | None,
    mu: Tensor,
    sigma: Tensor,
    noise: Tensor,
) -> tuple[Tensor, Tensor]:
    """S2's fits from a window's ``keep`` rows, its data's weight tempered by each w of
    :data:`TEMPER_GRID` (moments w·G, w·b under the broadcast prior ``mu``, ``sigma``, each
    repeated per w): the prediction φᵀm_w and the posterior spread φᵀV_wφ at every row,
    (clients, W, rows) each."""
    c, p, w_n = design.shape[0], design.shape[-1], len(TEMPER_GRID)
    tw = TEMPER_GRID.reshape(1, -1)
    base = moments(design, y, keep)
    if model is not None:
        base = _masked(base, model)
    stats = Moments(
        (base.gram.unsqueeze(1) * tw.reshape(1, -1, 1, 1)).reshape(c * w_n, p, p),
        (base.rhs.unsqueeze(1) * tw.unsqueeze(-1)).reshape(c * w_n, p),
        (base.yy.unsqueeze(1) * tw).reshape(-1),
        base.n.repeat_interleave(w_n, 0),
    )
    post = posterior(stats, mu, sigma, noise.repeat_interleave(w_n, 0))
    mean = post.mean.reshape(c, w_n, p)
    cov = post.cov.reshape(c, w_n, p, p)
    pred = torch.einsum("crp,cwp->cwr", design, mean)
    spread = ((design.unsqueeze(1) @ cov) * design.unsqueeze(1)).sum(-1)
    return pred, spread
