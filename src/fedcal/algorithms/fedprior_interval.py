"""The fleet prior's predictive intervals that hold, or none (``interval = "calibrated"``).

Intervals (``interval = "calibrated"``, issue 20). The model's own interval
φᵀV_iφ + σ² holds only if the basis is the truth and σ² is estimated. Neither
holds in a few-point fleet: a basis that fills a unit's points leaves zero
residuals (σ² collapses), and a design with K temperature plateaus cannot see
the curvature between them, which is then in no term of the variance (measured:
1.3 % coverage at 3×2 points, 20 % at 4×3; 83–88 % for new units of mixed
fleets, whose one-direction sweep carries the other branch's error). So:

I1. **Noise on residual degrees of freedom** (a restricted-likelihood type
    update): unit i uploads ν_i = n_i − tr(G_i V_i)/σ_i² (its points minus the
    effective parameters its posterior spends) and f_i = ‖y_i − Φ_i m_i‖²;
    σ² = Σ_i f_i / Σ_i ν_i. A unit whose basis saturates its points has ν_i ≈ 0
    and contributes no noise information; with Σ ν < 1 σ² is kept and the run
    declines (no interval).
I2. **A discrepancy variance from a design-matched hold-out.** Every unit with at
    most ``probe_rows`` rows uploads its inputs as positions in its own span
    (set points, no targets; with the sweep direction); the server broadcasts the
    smallest such design, the *probe* (K rows). A unit with at least 2K rows
    emulates it: it keeps, per probe row, its own nearest row, fits its posterior
    under the current prior from those K rows alone, and predicts all its other
    rows with the variance v the model states. It uploads, for each τ² of a fixed
    grid (:data:`TAU_GRID`), how many held-out rows satisfy |y − ŷ| ≤ 1.96 √(v + τ²),
    and how many rows it held out (sums only). The server takes the smallest τ²
    whose pooled held-out coverage reaches ``coverage_target`` (0.95; linear
    between the two grid values around it): a
    coverage-calibrated additive discrepancy variance, that holds whatever the
    error's shape (model form, hysteresis of a one-direction sweep, ripple).
I3. **Units that get it, and the decline.** A unit with fewer than 2K rows (the
    probe's class) predicts with variance φᵀV_iφ + σ_i² (+ the direction term) + τ²;
    a unit with more has τ² = 0 (its own points see what the probe cannot). The
    discrepancy at a K-row design is identified only by units with more rows: if
    none held out (every unit is of the probe's size), or no τ² of the grid covers,
    or Σ ν < 1, or the basis in use has weakly identified directions that carry more than
    half of a unit's predictive variance at its own calibration inputs (see Identification;
    that unit then, :meth:`~CalibratedInterval.weak_units`; collinear inputs leave such
    directions that no prediction leans on), the run states no interval for those units —
    :meth:`predictive_std` is NaN there, coverage is empty, the prediction stands —
    and says why in one line (:meth:`interval_note`, ``prior.json``'s
    ``interval.reason``, the summary's ``coverage_note``). A unit calibrated later
    from ``prior.json`` (``fedcal calibrate``) gets the same τ² by the same rule,
    and none (declined) if it has fewer rows than the probe (or the fleet had no
    unit of at most ``probe_rows`` rows): its model error was never learned.
I4. **The rich units' own-row τ² (``own_folds`` = F > 0; the shipped configurations' 5,
    the dataclass's 0 = off).** A unit with at
    least 2K rows also splits its own rows into F folds (row j of the unit in fold
    j mod F), fits its posterior under the current prior from the other folds, and
    counts for each τ² of :data:`TAU_GRID` the fold's rows within the interval I2
    states (±1.96 √(v + τ²), or the sweep mixture's); it uploads the counts and how
    many rows it held out, summed over folds. The server takes τ²_own as in I2 (the
    smallest τ² whose pooled coverage reaches ``coverage_target``), and the units
    with at least 2K rows predict with variance φᵀV_iφ + σ_i² + τ²_own. If no τ² of
    the grid covers, those units state no interval (:data:`DECLINE` 6). It learns
    what I3 assumes away: model error between a rich unit's own points and the
    uncertainty of its σ_i² (measured on the humidity fleet, docs/uncertainty.md). Cost:
    only units with at least 2K rows are fitted, the F folds in one batch, each fit
    predicting its own fold's rows (:meth:`~CalibratedInterval._own_counts`; the same
    counts as F fits of every unit predicting every row, tested to the bit).

:class:`CalibratedInterval` is a part of :class:`~fedcal.algorithms.fedprior.FedPrior` (its
``calibrated``), declared by the settings it reads (``interval``, ``probe_rows``,
``coverage_target``, ``own_folds``, ``min_informed``, ``noise``), the number of inputs, and
the parts it uses: the design and predictive form (``basis``, fedprior_basis), the noise
model (fedprior_noise: σ²(x) at a held row, the robust fit's row weights) and the selection
(fedprior_select: the full basis's mask). It holds the server's interval state
(:meth:`~CalibratedInterval.init`), a unit's hold-out uploads (I2,
:meth:`~CalibratedInterval.heldout`), the server's step I3 (:meth:`~CalibratedInterval.update`),
a unit's τ² and decline at personalization (:meth:`~CalibratedInterval.personal`) and the
one line a declined run prints (:meth:`~CalibratedInterval.note`). The residual terms of I1 are
computed in the E-step (fedprior_interval_parts.residual_terms); a unit's τ² enters its
predictive variance through ``variance_form``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from fedcal.algorithms.fedprior_basis import DesignBasis, model_mask, unit_noise
from fedcal.algorithms.fedprior_interval_parts import kept_moments, probe_unit, span_positions
from fedcal.algorithms.fedprior_noise import NoiseModel
from fedcal.algorithms.fedprior_rounds import carried_interval, probe_design, small_probe
from fedcal.algorithms.fedprior_select import EvidenceSelection, _masked
from fedcal.core.bayes import (
    F64,
    Moments,
    count_within,
    mixture_mass,
    posterior_moments,
    predictive_var,
)
from fedcal.core.data import ClientData
from fedcal.core.identify import UNLEARNED_SHARE, unlearned_directions, unlearned_share
from fedcal.core.tree import Tree, gather
from fedcal.models.basis import legendre_products

# τ² candidates of the hold-out (scaled units²: the target is scaled to O(1)): 0, then 10 per
# decade from 1e-12 to 1e2 (steps of 12 % in σ).
TAU_GRID = torch.cat([torch.zeros(1, dtype=F64), torch.logspace(-12, 2, 141, dtype=F64)])


# What the broadcast carries for the interval (the server also keeps "dof").
INTERVAL_KEYS = (
    "probe_x",
    "probe_b",
    "probe_n",
    "disc_var",
    "declined",
    "disc_own",
    "weak_proj",
)


DECLINE = {
    1: "no interval: no unit has residual degrees of freedom (Σ ν = {dof:.2g}): every unit's "
    "basis fits its points exactly, so the noise level cannot be estimated",
    2: "no interval: no unit has at least twice the points of the smallest design ({n} "
    "points), so the model error between its points cannot be learned from this fleet",
    3: "no interval: even the largest discrepancy variance did not cover 95 % of the "
    "held-out points of the units with more points than the smallest design ({n} points)",
    4: "no interval for units with fewer points than the fleet's smallest design ({n} points): "
    "their model error was not learned",
    5: "no interval: the fleet's points do not identify every direction of the basis in use "
    "(see the weak terms): an interval along them would be the vague start's, not learned",
    6: "no interval for units with at least twice the smallest design's points ({n} points): "
    "even the largest discrepancy variance did not cover 95 % of their own held-out rows",
}


# DECLINE 4 when the fleet had no unit of at most ``probe_rows`` points (no probe): a unit
# calibrated later with at most that many points has no learned model error ({n}: probe_rows).
NO_PROBE = (
    "no interval for units of at most {n} points (probe_rows): the fleet had no unit with so "
    "few points, so the model error of such a design was not learned"
)


# I3 with weakly identified directions: a unit-by-unit decline (FedPrior.personalize).
WEAK_NOTE = (
    "no interval for units whose predictive variance lies more than half along directions "
    "the fleet's points do not identify (status weak; the others' intervals are stated)"
)


@dataclass(frozen=True)
class CalibratedInterval:
    """Steps I1–I4 of the calibrated interval (module doc), declared by what they read."""

    interval: str  # "posterior" (the model's own interval: nothing here acts) or "calibrated"
    probe_rows: int  # a unit with at most this many rows may be the probe design
    coverage_target: float  # τ² is the smallest that covers this share of held-out rows
    own_folds: int  # I4's folds (0: off)
    min_informed: float  # a direction informed by fewer units is weakly identified (I3)
    noise: str  # "fleet" or "sensor": the σ² a hold-out fit states (fedprior_basis.unit_noise)
    inputs: int
    basis: DesignBasis
    noise_model: NoiseModel
    selection: EvidenceSelection

    @property
    def on(self) -> bool:
        """Whether the interval is the calibrated one (else this part adds nothing)."""
        return self.interval == "calibrated"

    def init(self) -> Tree:
        """The server's interval state before any sums (no probe, τ² 0)."""
        zero = torch.tensor(0.0, dtype=F64)
        p = len(self.basis.terms) + len(self.basis.branch_terms)
        return {
            "probe_x": torch.zeros(self.probe_rows, self.inputs, dtype=F64),
            "probe_b": torch.zeros(self.probe_rows, dtype=F64),
            "probe_n": zero.clone(),  # rows of the probe design; 0: none (yet)
            "disc_var": zero.clone(),  # τ², scaled units²
            "declined": zero.clone(),  # 0 an interval; else a DECLINE code
            "dof": zero.clone(),  # the fleet's residual degrees of freedom Σ_i ν_i
            # I3: the projector onto the basis's weakly identified directions (0: none)
            "weak_proj": torch.zeros(p, p, dtype=F64),
            # I4: the rich units' own-row τ² (only with own_folds, so that the state is
            # the earlier one without it)
            **({"disc_own": zero.clone()} if self.own_folds else {}),
        }

    def heldout(
        self,
        down: Tree,
        state: Tree,
        data: ClientData,
        weights: tuple[Tensor, Tensor] | None = None,
        count: bool = True,
    ) -> Tree:
        """A unit's design-matched hold-out (step I2): its uploads to the interval's sums.

        A unit with at least twice the probe's rows keeps, for each probe row, its own
        nearest row (by position in its own span, ``span_positions``; a row of the
        opposite sweep direction only if no other; without directions, its first visit of
        that set point), fits its posterior under the
        broadcast prior from those rows alone, and
        counts, for each τ² of :data:`TAU_GRID`, the other rows whose error lies within
        ±1.96 √(v + τ²) (v the predictive variance the fit states; with a direction term
        the sweep mixture's interval of the same variance, as :meth:`interval_halfwidth`
        states it). Every unit with at
        most ``probe_rows`` rows also uploads its inputs' span positions and directions
        (the server's candidate probe: chamber set points, no targets). ``weights``: the noise
        model's row weights and inliers (fedprior_noise, N5): the probe fit is weighted, σ²(x)
        is stated at each held row, and rows the robust fit marks as outliers are not counted.
        ``count`` False (fedprior_rounds R2, a round without the hold-out): the probe design
        only, no fits and no counts.
        """
        if not count:  # R2 (fedprior_rounds): this round uploads the probe design only
            return small_probe(data, self.probe_rows)
        pn = down["probe_n"].to(F64)
        able = ((data.count.to(F64) >= 2 * pn) & (pn > 0)).to(F64).unsqueeze(1)
        if not bool(able.any()):  # no unit can hold out (no probe yet): nothing to count
            return small_probe(data, self.probe_rows, (len(TAU_GRID), self.own_folds))
        x, y, mask = data.x.to(F64), data.y[..., 0].to(F64), data.mask.to(F64)
        c, rows = mask.shape
        branch = torch.zeros(c, rows, dtype=F64) if data.branch is None else data.branch.to(F64)
        px, pb = down["probe_x"].to(F64), down["probe_b"].to(F64)
        valid = (torch.arange(px.shape[1]).unsqueeze(0) < pn.unsqueeze(1)).to(F64)
        u = span_positions(x, mask)  # positions within the unit's own calibrated span
        n = data.count.to(F64)
        probe = probe_design(u, branch, n, self.probe_rows)
        dist = torch.cdist(px, u) + 1e3 * ((pb.unsqueeze(-1) * branch.unsqueeze(-2)) < 0)
        dist = dist.masked_fill(mask.unsqueeze(1) == 0, math.inf)
        nearest = dist.argmin(-1)
        if data.branch is None:
            # No sweep directions: a probe design is one pass, so at each set point (rows
            # within 2 % of the span of the nearest) the unit's first visit is kept, not
            # whichever of its passes reads closest (that mixes branches of a hysteresis).
            near = dist <= dist.min(-1, keepdim=True).values + 0.02
            nearest = near.to(torch.int8).argmax(-1)  # the first such row in measured order
        keep = torch.zeros(c, rows, dtype=F64).scatter_reduce(
            1, nearest, valid, "amax", include_self=True
        )
        keep, held = keep * able, mask * (1 - keep) * able
        design = self.basis.design(x, data.branch)
        if weights is not None:  # N5: held rows the robust fit marks outliers not counted
            held = held * weights[1]
        w = None if weights is None else weights[0]  # N5: the weighted fit
        inside = self._fit_count(down, state, kept_moments(design, y, keep, w), x, y, held)
        out = {**probe, "inside": inside, "held": held.sum(1)}
        if self.own_folds:  # I4: the rich units hold out their own rows, fold by fold
            out["inside_own"], out["held_own"] = self._own_counts(
                down, state, design, x, y, mask, able[:, 0], weights
            )
        return out

    def _own_counts(
        self,
        down: Tree,
        state: Tree,
        design: Tensor,
        x: Tensor,
        y: Tensor,
        mask: Tensor,
        able: Tensor,
        weights: tuple[Tensor, Tensor] | None,
    ) -> tuple[Tensor, Tensor]:
        """I4's uploads: per unit, the counts per τ² of its own held-out rows inside the
        interval, summed over the F folds (row j of the unit in fold j mod F), and how many
        rows it held out: (clients, grid), (clients,).

        Each fold's fit is I4's (the unit's posterior under the broadcast prior from its
        other folds), but only the units that hold out (``able``: at least twice the probe's
        rows) are fitted, the F folds in one batch, and each fit predicts only its own fold's
        rows: the same numbers as F fits of every unit predicting every row (counts of
        0/1 rows), at a fraction of the cost (docs/uncertainty.md, "I4 by default").
        """
        c, rows = mask.shape
        f = self.own_folds
        inside = torch.zeros(c, TAU_GRID.shape[0], dtype=F64)
        held = torch.zeros(c, dtype=F64)
        rich = torch.nonzero(able > 0)[:, 0]
        if rich.numel() == 0:  # no unit holds out: nothing to count
            return inside, held
        m = mask.index_select(0, rich)
        pos = m.cumsum(1) - 1  # the row's index among its unit's rows
        part = m * (torch.remainder(pos, f).unsqueeze(0) == torch.arange(f).reshape(f, 1, 1))
        ok = None if weights is None else weights[1].index_select(0, rich)
        yr, dr = y.index_select(0, rich), design.index_select(0, rich)
        w0 = None if weights is None else weights[0].index_select(0, rich)
        # the fits, one per (fold, unit), fold-major: moments of the other folds' rows
        sub = [kept_moments(dr, yr, m - part[k], w0) for k in range(f)]
        stats = Moments(*(torch.cat(v) for v in zip(*sub, strict=True)))
        batch = rich.repeat(f)
        # the broadcast's rows the fits read (not the BIC candidates' priors)
        down = gather({k: v for k, v in down.items() if k != "cand"}, batch)
        # each fit predicts its own fold's rows only (in row order; shorter folds padded)
        width = math.ceil(float(m.sum(1).max()) / f)
        order = torch.argsort((part == 0).to(torch.int8), dim=-1, stable=True)[..., :width]
        order = order.reshape(f * rich.numel(), width)
        fold_rows = part.reshape(f * rich.numel(), rows).gather(1, order)
        if ok is not None:  # N5: rows the robust fit marks as outliers are not counted
            fold_rows = fold_rows * ok.repeat(f, 1).gather(1, order)
        xs = x.index_select(0, batch)
        xs = xs.gather(1, order.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        ys = yr.repeat(f, 1).gather(1, order)
        counts = self._fit_count(down, gather(state, batch), stats, xs, ys, fold_rows)
        inside[rich] = counts.reshape(f, rich.numel(), -1).sum(0)
        held[rich] = fold_rows.reshape(f, rich.numel(), width).sum((0, 2))
        return inside, held

    def _fit_count(
        self, down: Tree, state: Tree, sub: Moments, x: Tensor, y: Tensor, held: Tensor
    ) -> Tensor:
        """Fit each unit's posterior under the broadcast prior from the moments ``sub`` of its
        kept rows alone (:func:`kept_moments`) and count, per τ² of :data:`TAU_GRID`, its
        ``held`` rows (x, y) inside the interval it states (I2; I4 a fit per fold and unit):
        (clients, grid)."""
        coef, cov, noise = self._fit(down, state, sub)
        return self._count(down, coef, cov, noise, x, y, held)

    def _fit(self, down: Tree, state: Tree, sub: Moments) -> tuple[Tensor, Tensor, Tensor]:
        """A hold-out fit (I2, I4): the posterior (mean, covariance) under the broadcast prior
        from the moments ``sub`` of the kept rows, in the basis in use, and σ_i²."""
        model = model_mask(down)
        stats = sub if model is None else _masked(sub, model)
        noise = unit_noise(self.noise, down, state)
        coef, cov = posterior_moments(stats, down["mu"], down["sigma"], noise)
        if "mask" in down:  # as in personalize: terms outside the chosen basis are not in it
            m = down["mask"]
            coef, cov = coef * m, cov * m.unsqueeze(-1) * m.unsqueeze(-2)
        return coef, cov, noise

    def _count(
        self,
        down: Tree,
        coef: Tensor,
        cov: Tensor,
        noise: Tensor,
        x: Tensor,
        y: Tensor,
        held: Tensor,
    ) -> Tensor:
        """Per τ² of :data:`TAU_GRID`, how many ``held`` rows (x, y) of each unit lie inside
        the interval a fit (coef, cov, σ_i²) states there: (clients, grid)."""
        mean, var = self._mean_var(coef, cov, noise, x, down)
        if self.basis.branch_terms:  # the stated interval is the sweep mixture's (halfwidth)
            err = (y - mean).abs().unsqueeze(-1)
            h = coef[..., len(self.basis.terms) :].unsqueeze(1)
            shift = (legendre_products(x, self.basis.branch_terms) * h).sum(-1).unsqueeze(-1)
            sd = (var.unsqueeze(-1) - shift * shift + TAU_GRID).clamp_min(0.0).sqrt()
            within = mixture_mass(err, shift, sd) <= 0.95
            return (within.to(F64) * held.unsqueeze(-1)).sum(1)
        # held rows within ±1.96√(v + τ²) per τ² of the grid (bisection: no rows × grid)
        return count_within((y - mean).square(), var, TAU_GRID, held, 1.959964)

    def _mean_var(self, coef: Tensor, cov: Tensor, noise: Tensor, x: Tensor, down: Tree):
        """φᵀm_c and the predictive variance of ``variance_form`` per row (clients, rows)
        for a posterior (coef, cov) and noise σ_i²: the hold-out's predictions (I2); with the
        noise in the inputs, σ_i² exp(γᵀx) at each row (fedprior_noise)."""
        coef = coef.to(F64)
        mean = self.basis.mean(coef, x)
        noise = noise.to(F64).expand(cov.shape[:-2])  # one σ² per unit (a fleet's: broadcast)
        q, s = self.basis.variance_form({"coef": coef, "cov": cov, "noise_var": noise})
        var = predictive_var(self.basis.variance_design(x), q, s)
        if "noise_gamma" in down:
            excess = self.noise_model.excess(
                {"noise_var": noise, "noise_gamma": down["noise_gamma"]}, x
            )
            var = var if excess is None else var + excess
        return mean, var

    def update(self, server: Tree, replies: Tree, order: Tensor, total: dict) -> Tree:
        """The server's step I3: the probe, τ² from the hold-out sums, and whether to decline."""
        if not self.on:
            return {}
        iv = {k: v[order] for k, v in replies["interval"].items()}
        out = self.init()
        j = probe_unit(iv["n"])
        if j is not None:
            out.update(probe_x=iv["x"][j], probe_b=iv["b"][j], probe_n=iv["n"][j])
        out["dof"] = total["dof"]
        if "held" not in iv:  # R2 (fedprior_rounds): no hold-out this round, τ² carried over
            return carried_interval(server, self._weak_state(server, total, out))
        code = 0
        if float(server["probe_n"]) > 0:  # the units held out against this probe
            held = float(iv["held"].sum())
            if held == 0:
                code = 2
            else:
                tau = self.tau_of(iv["inside"].sum(0) / held)
                if math.isnan(float(tau)):
                    code = 3
                else:
                    out["disc_var"] = tau
            if "held_own" in iv:  # I4: the rich units' own-row τ² (NaN: none covered)
                held_own = float(iv["held_own"].sum())
                if held_own > 0:
                    out["disc_own"] = self.tau_of(iv["inside_own"].sum(0) / held_own)
        out = self._weak_state(server, total, out)  # I3's weak directions (personalize)
        if float(total["dof"]) < 1.0:
            code = 1
        out["declined"] = torch.tensor(float(code), dtype=F64)
        return out

    def _weak_state(self, server: Tree, total: dict, out: Tree) -> Tree:
        """``out`` with I3's projector onto the basis's weakly identified directions."""
        used = torch.nonzero(server["mask"] if "mask" in server else self.selection.masks[-1])
        used = used[:, 0]
        weak = unlearned_directions(total["support"][used][:, used], self.min_informed)
        out["weak_proj"][used.unsqueeze(1), used.unsqueeze(0)] = weak @ weak.T
        return out

    def personal(self, down: Tree, cov: Tensor, noise: Tensor, data: ClientData) -> Tree:
        """A unit's τ² and whether its interval is declined (I3, I4), from the broadcast
        and its posterior covariance ``cov`` and σ_i² ``noise``; {} without a broadcast τ²."""
        if "disc_var" not in down:
            return {}
        n, probe = data.count.to(F64), down["probe_n"].to(F64)
        small = n < 2 * probe  # τ² for units of the probe's size
        # A unit smaller than any design the fleet held out for (only a unit calibrated
        # later from prior.json can be): its model error was never learned.
        unknown = (n < probe) | ((probe == 0) & (n <= self.probe_rows))
        code = down["declined"]
        # I4: the rich units' own-row τ² (NaN: none of the grid covered; 0 when off)
        own = down.get("disc_own", torch.tensor(0.0, dtype=F64)).to(F64)
        rich_var = torch.nan_to_num(own, nan=0.0).expand_as(n)
        disc_var = torch.where(small, down["disc_var"].to(F64), rich_var)
        lost = ~small & torch.isnan(own) & (probe > 0)
        # I3: weakly identified directions decline the units they carry (weak_units)
        weak = self.weak_units(down, cov, noise, data)
        declined = (code == 1) | weak | (small & (code > 1) & (code != 5)) | unknown | lost
        return {"disc_var": disc_var, "declined": declined.to(F64)}

    def weak_units(self, down: Tree, cov: Tensor, noise: Tensor, data: ClientData) -> Tensor:
        """(clients,) bool: the units I3 states no interval for because the basis's weakly
        identified directions W (spanning ``weak_proj``) carry more than ``UNLEARNED_SHARE``
        of their predictive variance where they are used
        (:func:`~fedcal.core.identify.unlearned_share`). "Where they are used" is the
        midpoint of each two consecutive calibration rows: between its points, where a
        unit interpolates; at the points themselves its own data pin the prediction
        whatever W holds (a unit of two points off the fleet's inputs would pass there).
        Along W the prior is the vague start's; a unit whose inputs barely project on W
        (collinear channels, their difference's products: ~1e-5 of its σ²) has an interval
        the fleet learned. A prior without the projector (an older prior.json, decline
        code 5) declines every unit."""
        c = data.num_clients
        proj = down.get("weak_proj")
        if proj is None:
            return (down["declined"].to(F64) == 5).expand(c).clone()
        if not bool((proj != 0).any()):
            return torch.zeros(c, dtype=torch.bool)
        proj = proj.reshape(-1, *proj.shape[-2:])[0]  # one broadcast (an engine may batch it)
        x, mask = data.x.to(F64), data.mask.to(F64)
        if x.shape[1] > 1:  # midpoints of consecutive rows; a unit of one row: that row
            pair = mask[:, :-1] * mask[:, 1:]
            one = (mask.sum(1) == 1).to(F64).unsqueeze(1)
            x = torch.cat([0.5 * (x[:, :-1] + x[:, 1:]), x[:, :1]], 1)
            mask = torch.cat([pair, one * mask[:, :1]], 1)
        p = len(self.basis.terms)  # φ's coordinates: the share of what predict states
        phi = legendre_products(x, self.basis.terms)
        noise = noise.to(F64).reshape(-1).expand(c)
        share = unlearned_share(phi, cov[..., :p, :p], noise, proj.to(F64)[:p, :p], mask)
        return share > UNLEARNED_SHARE

    def tau_of(self, share: Tensor) -> Tensor:
        """The smallest τ² whose held-out coverage ``share`` (per τ² of :data:`TAU_GRID`)
        reaches ``coverage_target``, linear between the grid's neighbours; NaN if none."""
        covered = share >= self.coverage_target
        if not bool(covered.any()):
            return torch.tensor(math.nan, dtype=F64)
        g = int(torch.nonzero(covered)[0, 0])
        if g == 0:
            return TAU_GRID[0].clone()
        w = (self.coverage_target - share[g - 1]) / (share[g] - share[g - 1])
        return TAU_GRID[g - 1] + w * (TAU_GRID[g] - TAU_GRID[g - 1])

    def note(self, server: Tree) -> str:
        """One line: why the run states no interval for (some) units; "" when it states them."""
        if not self.on:
            return ""
        code = int(server["declined"])
        own = "disc_own" in server and math.isnan(float(server["disc_own"]))
        note = (
            DECLINE[code].format(n=int(server["probe_n"]), dof=float(server["dof"])) if code else ""
        )
        if code != 1 and "weak_proj" in server and bool((server["weak_proj"] != 0).any()):
            note = f"{note}; and {WEAK_NOTE}" if note else WEAK_NOTE
        if own and code not in (1, 5):  # I4 found no τ² for the rich units (too)
            rich = DECLINE[6].format(n=int(server["probe_n"]))
            return f"{note}; and {rich}" if note else rich
        return note
