"""The fleet prior's noise model in the inputs, and robust to outlying points (issues 20, 26).

fedprior's noise is one variance per fleet or per unit, constant over the inputs. Two regimes
break that: noise that grows with the level (a capacitive humidity sensor, a PM2.5 network
whose reference noise is multiplicative) and outliers among the calibration points. The two
settings of :class:`~fedcal.algorithms.fedprior.FedPrior` here change the noise model:

    ε_r ~ N(0, σ_i² · exp(γᵀ g(x_r)) / u_r),

N1. **Input-dependent variance** (``noise_shape = "inputs"``): g(x) = x, the scaled inputs
    (clamped to the unit's support box in use, so σ(x) does not grow without bound beyond
    the calibrated range), γ one vector shared by the fleet. Given γ, the E-step is weighted
    least squares: row r's moments carry the weight ω_r = exp(−γᵀ g(x_r)) and every step of
    :mod:`fedcal.core.bayes` runs unchanged on Σ ω φφᵀ, Σ ω φ y, Σ ω y² (σ_i² is then the
    variance at g = 0).
N2. **γ by the fleet's sums** (Fisher scoring of a per-unit profile likelihood): from its
    posterior (m_i, V_i) unit i has expected squared residuals
    a_r = (y_r − φ_rᵀm_i)² + φ_rᵀV_iφ_r (EM's expectation; over the rows N5 keeps as
    inliers). With its own scale profiled out, its log-likelihood in γ is
    ℓ_i(γ) = −½[n_i log A_i(γ) + Σ_r γᵀg_r] + const,
    A_i(γ) = Σ_r a_r e^{−γᵀg_r}. The unit uploads the score s_i = Σ_r (ẑ_r − 1) g_r
    (ẑ_r = n_i a_r e^{−γᵀg_r} / A_i(γ)), the information J_i = Σ_r (g_r − ḡ_i)(g_r − ḡ_i)ᵀ,
    and d_i = ℓ_i(γ) − ℓ_i(0); the server steps γ ← γ + (Σ J_i)⁻¹ Σ s_i (a step longer than
    :data:`MAX_STEP` is shortened). Per-unit profiling keeps units of different noise levels
    (log-uniform σ_i) from reading as a trend in x.
N3. **Selected by evidence**: the E-step uses γ only while the fleet's likelihood ratio beats
    BIC's penalty, 2 Σ_i d_i > k log Σ_i n_i (k inputs); otherwise γ = 0 is in use (a
    homoscedastic fleet keeps today's model) while the iterate keeps being refined.
N4. **Student-t rows** (``noise_tail = "student"``, ν = ``noise_dof``): EM for the t
    distribution as a scale mixture of normals (Lange, Little & Taylor 1989). Each round the
    unit iterates :data:`IRLS_STEPS` times: posterior under the weights, then
    u_r = (ν + 1)/(ν + ω_r e_r²/s²), e_r² the expected squared residual, s² the unit's own
    noise level from its weighted residuals, shrunk toward the fleet's σ² by ν₀ pseudo-points
    as in fedprior's step 1, with either ``noise`` setting (the first step: the fleet's): a row
    is judged against its unit's spread. With the fleet's σ² alone, the rows of a noisy unit
    get small weights and κ_ν's consistency fails when units differ in noise (measured on a
    planted clean fleet, σ_i over a factor 2: σ² −5 %). Rows enter the moments with weight
    ω_r u_r / κ_ν,
    κ_ν = E[(ν + 1)ξ²/(ν + ξ²)], ξ ~ N(0, 1): the constant that makes σ² = Σ(ωu/κ)e²/n an
    M-estimator of scale consistent at the normal, so a clean fleet keeps its σ² and its
    intervals (the t scale alone is below the normal's). A row beyond 6 σ(x)
    (ω e²/s² > :data:`OUTLIER_Z2`; probability 2·10⁻⁹ under the normal) is a gross outlier and
    gets u = 0: the t weight alone leaves each one a bounded but non-zero share (ν + 1)s²/κ_ν
    of the residual sum, which inflates σ² by 1/(1 − f(ν + 1)/κ_ν) at a share f of outliers
    (measured +30–40 % at 5 %; by the formula 5× for one outlier among 8 points: fedprior_sensor
    over-covered, 0.98–0.99). So an
    outlier neither pulls the coefficients nor inflates σ². A cut at 4 σ measured worse (clean
    rows of a model-form misfit were cut: coverage 0.89 on the clean humidity fleet).
N5. **The hold-out** (fedprior_interval, I2) fits its probe design with these weights, states
    σ²(x) at the held rows, and does not count a held row the unit's robust fit marks as an
    outlier (ω e²/s² > :data:`OUTLIER_Z2`, |e| beyond 6 σ(x): probability 2·10⁻⁹ under the
    Gaussian noise): τ² is calibrated to the clean points' error, not to the outliers'. γ's
    terms (N2) are taken over the same inliers.

N6. **The tail chosen by the fleet's data** (``noise_tail = "auto"``): each round every unit
    fits its rows both ways, Gaussian (weights ω_r) and Student-t (N4's weights), and uploads
    d_i = ℓ_i^t − ℓ_i^N, its log-likelihood under each at its own fit and its own profiled
    scale: with e_r² the expected squared residuals of that fit,
    ℓ_i^N = −½ n_i (log(2π s_N²) + 1), s_N² = Σ ω_r e_r² / n_i, and
    ℓ_i^t = Σ_r log t_ν(√ω_r e_r / s_t) − n_i log s_t, s_t² the t scale's MLE (its EM
    fixed point s² ← Σ (ν + 1) ω e² / (ν + ω e²/s²) / n_i); the terms in ω that both share
    cancel. The server keeps t rows (N4) for the next round only while the fleet's sum beats
    BIC's penalty for ν, one added parameter (Gaussian: ν = ∞): 2 Σ_i d_i > log Σ_i n_i
    (:data:`TAIL_PENALTY` × that). A d_i is the unit's own; like γ's terms it is a sum
    over its rows, uploaded unscreened under ``noise/``. Round 0 decides at the vague start,
    before residuals are the fleet's (measured: it chose t on every fleet tried; round 1's
    evidence reversed it where t was not kept). The last round's choice is the model's and
    travels in ``prior.json`` (``noise_student``).
N7. **Gross outliers out, Gaussian rows** (``noise_tail = "trim"``): the unit runs N4's
    t fit only to judge its rows (robust: an outlier does not pull the fit it is judged
    by); a row beyond 6 σ(x) of it (N5's gross outlier) gets weight 0, every other row
    its Gaussian weight ω_r (no t down-weighting, no κ_ν). The moments, σ² and γ are then
    the Gaussian model's over the inliers; under Gaussian noise a share 2·10⁻⁹ of rows is
    cut. It separates N4's two effects: the soft t weights of the bulk of the rows
    (measured to cost RMSE on field networks whose large residuals are real) and the
    removal of gross outliers (what a few bad calibration points need).
Use: the predictive variance is φᵀVφ + σ_i² exp(γᵀ g(x)) (+ τ²) at the query input
(:meth:`NoiseModel.excess` adds σ_i²(exp(γᵀg) − 1) to the constant-noise form, which
the linear exports reproduce only with γ = 0: they refuse otherwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from fedcal.core.bayes import F64, Moments, posterior
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree

IRLS_STEPS = 3  # N4: t-weights refitted this many times per round (the rounds continue it)
MAX_STEP = 2.0  # N2: the longest γ step per round (scaled inputs: a factor e² in variance)
OUTLIER_Z2 = 36.0  # N5: a row beyond 6 σ(x) of the unit's robust fit is a gross outlier
SCALE_STEPS = 30  # N6: EM steps of the t scale's MLE (tested against scipy's fit to 1e-6)
TAIL_PENALTY = 1.0  # N6: BIC's log Σn for ν, one parameter, times this
# Hostile sites: each unit's d_i (N3, N6) clipped to ± this many nats per row; honest maxima
# measured 2.1 (γ, field networks) and 1.61 (tail, humidity fleet) (docs/uncertainty.md)
NOISE_EVIDENCE_CLIP = 4.0


def weighted_moments(design: Tensor, y: Tensor, mask: Tensor, weight: Tensor) -> Moments:
    """Σ w φφᵀ, Σ w φ y, Σ w y², n = Σ mask (rows counted once whatever their weight)."""
    w = (mask.to(F64) * weight.to(F64)).unsqueeze(-1)
    phi, y = design.to(F64), y.to(F64)
    return Moments(
        phi.transpose(1, 2) @ (phi * w),
        (phi * w * y.unsqueeze(-1)).sum(1),
        (w[..., 0] * y * y).sum(1),
        mask.to(F64).sum(1),
    )


def sensor_noise(rss: Tensor, n: Tensor, fleet: Tensor, nu: float) -> Tensor:
    """σ_i² = (r_i + ν σ²)/(n_i + ν): the MAP under a scaled-inv-χ²(ν, σ²) prior."""
    return (rss + nu * fleet) / (n + nu)


def _rows(v: Tensor) -> Tensor:
    """A per-unit vector (clients, k) or a fleet's (k,) against rows (clients, rows, k)."""
    v = v.to(F64)
    return v.unsqueeze(-2) if v.dim() == 2 else v


def clip_evidence(noise: Tree, n: Tensor, clip: float) -> Tree:
    """The noise uploads with each unit's log-likelihood ratios (γ's d_i of N3, the tail's
    d_i of N6) clipped to ± ``clip`` · n_i nats: the BIC tests add them over units, so
    unclipped one unit could force γ or the Student-t rows by forging its d_i."""
    bound = clip * n.to(F64).reshape(-1)
    out = dict(noise)
    for key in ("ratio", "tail_ratio"):
        if key in out:
            out[key] = torch.maximum(torch.minimum(out[key].to(F64), bound), -bound)
    return out


def t_weight_constant(nu: float) -> float:
    """κ_ν = E[(ν + 1)ξ²/(ν + ξ²)], ξ ~ N(0, 1) (N4), by Gauss–Hermite quadrature."""
    x, w = np.polynomial.hermite_e.hermegauss(150)
    return float(np.sum(w * (nu + 1) * x * x / (nu + x * x)) / math.sqrt(2 * math.pi))


@dataclass(frozen=True)
class NoiseModel:
    """Steps N1–N7 (module doc): a part of :class:`~fedcal.algorithms.fedprior.FedPrior` (its
    ``noise_model``), declared by the settings that shape the noise: ``noise_shape``,
    ``noise_tail``, ``noise_dof`` (ν of the t rows) and ``noise_prior_points`` (ν of each
    unit's own scale, :func:`sensor_noise`)."""

    noise_shape: str  # "constant" or "inputs"
    noise_tail: str  # "gaussian", "student", "auto" or "trim"
    noise_dof: float
    noise_prior_points: float

    def init(self, inputs: int) -> Tree:
        """The noise model's server state before any sums: γ in use, its iterate and the
        fleet's ratio (N2, N3; ``noise_shape = "inputs"``), Gaussian rows until the fleet's
        evidence says t (N6; ``noise_tail = "auto"``); {} otherwise."""
        start = {}
        if self.noise_shape == "inputs":
            zero = torch.zeros(inputs, dtype=F64)
            start.update(noise_gamma=zero, noise_gamma_fit=zero.clone())
            start["noise_ratio"] = torch.tensor(0.0, dtype=F64)
        if self.noise_tail == "auto":
            start["noise_student"] = torch.tensor(0.0, dtype=F64)
            start["tail_ratio"] = torch.tensor(0.0, dtype=F64)
        return start

    @property
    def weighted(self) -> bool:
        """Whether rows carry weights (the E-step's moments depend on the broadcast)."""
        return self.noise_shape != "constant" or self.noise_tail != "gaussian"

    def student_in_use(self, down: Tree) -> bool:
        """Whether rows are Student-t this round: always with ``"student"``; with ``"auto"``
        while the fleet's evidence chose it (N6; round 0 and a model without it: Gaussian)."""
        if self.noise_tail == "auto":
            return "noise_student" in down and bool((down["noise_student"] > 0.5).all())
        return self.noise_tail in ("student", "trim")

    @cached_property
    def kappa(self) -> float:
        return t_weight_constant(self.noise_dof)

    @staticmethod
    def features(x: Tensor, box: Tensor | None = None) -> Tensor:
        """g(x): the scaled inputs, clamped to ``box`` (clients, 2, inputs) or (2, inputs)."""
        g = x.to(F64)
        if box is not None:
            box = box.to(F64)
            lo, hi = box[..., 0, :], box[..., 1, :]
            if lo.dim() == 2:  # per unit
                lo, hi = lo.unsqueeze(1), hi.unsqueeze(1)
            g = torch.maximum(torch.minimum(g, hi), lo)
        return g

    def gamma(self, down: Tree) -> Tensor | None:
        """γ in use (N3), or None when the noise does not depend on the inputs."""
        if self.noise_shape == "constant" or "noise_gamma" not in down:
            return None
        return down["noise_gamma"].to(F64)

    def excess(self, params: Tree, x: Tensor) -> Tensor | None:
        """σ_i²(exp(γᵀg(x)) − 1) per row (clients, rows): what σ²(x) adds to the constant
        noise of ``variance_form``; None when γ is not in the model."""
        gamma = params.get("noise_gamma")
        if gamma is None or self.noise_shape == "constant":
            return None
        gamma = gamma.to(F64)
        g = self.features(x, params.get("box"))
        lin = (g * _rows(gamma)).sum(-1)
        noise = params["noise_var"].to(F64).reshape(-1, 1)
        return noise * torch.expm1(lin)

    def row_weights(
        self, down: Tree, data: ClientData, design: Tensor, noise: Tensor | None = None
    ) -> tuple[Tensor, Tensor] | None:
        """(w, inlier) per row (clients, rows): w = ω u/κ (N1, N4) and whether the robust fit
        keeps the row as an inlier (N5); None when the model is today's (no weights)."""
        if not self.weighted:
            return None
        c, rows = data.mask.shape
        gamma = self.gamma(down)
        omega = torch.ones(c, rows, dtype=F64)
        if gamma is not None:
            omega = torch.exp(-(self.features(data.x) * _rows(gamma)).sum(-1))
        inlier = torch.ones(c, rows, dtype=F64)
        if self.noise_tail == "gaussian" or not self.student_in_use(down):
            return omega, inlier
        y, mask = data.y[..., 0].to(F64), data.mask.to(F64)
        if "mask" in down:  # the chosen basis only (terms outside it are not in the model)
            design = design.to(F64) * _rows(down["mask"])
        fleet = down["noise_var"].to(F64).reshape(-1).expand(c)
        scale = fleet if noise is None else noise.to(F64).reshape(-1).expand(c)
        weight, nu = omega, self.noise_dof
        for _ in range(IRLS_STEPS):
            stats = weighted_moments(design, y, mask, weight)
            post = posterior(stats, down["mu"], down["sigma"], scale)
            z2 = omega * self.expected_sq(design, y, post) / scale.unsqueeze(-1)
            u = (nu + 1.0) / (nu + z2) * (z2 <= OUTLIER_Z2)  # a gross outlier: skipped
            weight = omega * u / self.kappa
            # the unit's own scale, shrunk toward the fleet's: a row is judged against its
            # unit's spread (units differ in noise; their rows are not outliers of the fleet's)
            r = (weight * mask * self.expected_sq(design, y, post)).sum(1)
            scale = sensor_noise(r, stats.n, fleet, self.noise_prior_points)
        inlier = (z2 <= OUTLIER_Z2).to(F64)
        if self.noise_tail == "trim":  # N7: Gaussian rows, the t fit's gross outliers out
            return omega * inlier, inlier
        return weight, inlier

    def moments(self, design: Tensor, data: ClientData, rw: tuple[Tensor, Tensor]) -> Moments:
        """The E-step moments of weighted rows (N1, N4); under ``trim`` (N7) the cut rows are
        out of the model, so out of n too: σ² = RSS / n over the inliers (counting them would
        lower σ² by the outlier share)."""
        count = data.mask * rw[1] if self.noise_tail == "trim" else data.mask
        return weighted_moments(design, data.y[..., 0], count, rw[0])

    def tail_ratio(self, down: Tree, data: ClientData, design: Tensor) -> Tensor:
        """d_i = ℓ_i^t − ℓ_i^N per unit (N6): each tail's log-likelihood at its own fit."""
        forced = {**down, "noise_student": torch.tensor(1.0, dtype=F64)}
        t_weight, _ = self.row_weights(forced, data, design)
        gauss = {**down, "noise_student": torch.tensor(0.0, dtype=F64)}
        omega, _ = self.row_weights(gauss, data, design)
        y, mask = data.y[..., 0].to(F64), data.mask.to(F64)
        if "mask" in down:
            design = design.to(F64) * _rows(down["mask"])
        c = mask.shape[0]
        scale = down["noise_var"].to(F64).reshape(-1).expand(c)
        n = mask.sum(1).clamp_min(1.0)
        nu = self.noise_dof
        fits = []
        for w in (omega, t_weight):
            post = posterior(weighted_moments(design, y, mask, w), down["mu"], down["sigma"], scale)
            fits.append(omega * self.expected_sq(design, y, post) * mask)
        # Gaussian, scale profiled: −½ n (log 2π s² + 1)
        s_n = (fits[0].sum(1) / n).clamp_min(1e-300)
        loglik_n = -0.5 * n * (math.log(2 * math.pi) + torch.log(s_n) + 1.0)
        # Student-t, scale by its EM fixed point (starting at the Gaussian's of the t fit)
        z = fits[1]
        s_t = (z.sum(1) / n).clamp_min(1e-300)
        for _ in range(SCALE_STEPS):
            s_t = ((nu + 1.0) * z / (nu + z / s_t.unsqueeze(1)) * mask).sum(1) / n
            s_t = s_t.clamp_min(1e-300)
        const = math.lgamma((nu + 1) / 2) - math.lgamma(nu / 2) - 0.5 * math.log(nu * math.pi)
        per_row = const - 0.5 * (nu + 1.0) * torch.log1p(z / (nu * s_t.unsqueeze(1)))
        loglik_t = (per_row * mask).sum(1) - 0.5 * n * torch.log(s_t)
        ok = (mask.sum(1) > 1).to(F64)  # one row: nothing about the tail within the unit
        return (loglik_t - loglik_n) * ok

    def updates(
        self, server: Tree, noise: Tree, order: Tensor, rows: Tensor, unit_rows: Tensor
    ) -> Tree:
        """γ's step and test (N2–N3) and the tail's test (N6), as the model has them, on each
        unit's evidence clipped to ± NOISE_EVIDENCE_CLIP · n_i (:func:`clip_evidence`)."""
        noise = clip_evidence(noise, unit_rows, NOISE_EVIDENCE_CLIP)
        out = self.gamma_update(server, noise, order, rows) if "score" in noise else {}
        if "tail_ratio" in noise:
            out.update(self.tail_update(noise, order, rows))
        return out

    @staticmethod
    def tail_update(noise: Tree, order: Tensor, rows: Tensor) -> Tree:
        """The server's step N6: Student-t rows while 2 Σ d_i > log Σ n_i (BIC, one ν)."""
        ratio = noise["tail_ratio"][order].sum(0)
        chosen = 2.0 * float(ratio) > TAIL_PENALTY * math.log(max(float(rows), 2.0))
        return {"noise_student": torch.tensor(float(chosen), dtype=F64), "tail_ratio": ratio}

    @staticmethod
    def expected_sq(design: Tensor, y: Tensor, post) -> Tensor:
        """E[(y_r − φ_rᵀc)²] = (y_r − φ_rᵀm)² + φ_rᵀVφ_r per row (clients, rows)."""
        phi = design.to(F64)
        resid = y - (phi * post.mean.unsqueeze(1)).sum(-1)
        spread = torch.einsum("crp,cpq,crq->cr", phi, post.cov, phi)
        return resid * resid + spread.clamp_min(0.0)

    def uploads(self, down: Tree, data: ClientData, design: Tensor, post, inlier: Tensor) -> Tree:
        """A unit's uploads for γ (N2): score, information, log-likelihood ratio d_i, over the
        rows the robust fit keeps (``inlier``; all without Student-t rows)."""
        mask, y = data.mask.to(F64) * inlier, data.y[..., 0].to(F64)
        c = mask.shape[0]
        gamma = down["noise_gamma_fit"].to(F64)
        if "mask" in down:  # the chosen basis only, as the posterior's
            design = design.to(F64) * _rows(down["mask"])
        g = self.features(data.x)
        a = self.expected_sq(design, y, post) * mask
        lin = (g * _rows(gamma)).sum(-1)
        a_g = a * torch.exp(-lin)
        big_a = a_g.sum(1).clamp_min(1e-300)
        n = mask.sum(1)
        z = n.unsqueeze(1) * a_g / big_a.unsqueeze(1)
        score = ((z - 1.0) * mask).unsqueeze(-1).mul(g).sum(1)
        g_bar = (g * mask.unsqueeze(-1)).sum(1) / n.clamp_min(1.0).unsqueeze(-1)
        gc = (g - g_bar.unsqueeze(1)) * mask.unsqueeze(-1)
        info = gc.transpose(1, 2) @ gc
        a0 = a.sum(1).clamp_min(1e-300)
        ratio = -0.5 * (n * torch.log(big_a / a0) + (lin * mask).sum(1))
        ok = (n > 1).to(F64)  # one row: nothing about γ within the unit
        return {
            "score": score * ok.unsqueeze(-1),
            "info": info * ok.reshape(c, 1, 1),
            "ratio": ratio * ok,
        }

    def gamma_update(self, server: Tree, noise: Tree, order: Tensor, rows: Tensor) -> Tree:
        """The server's steps N2–N3: γ's scoring step and the evidence test."""
        score = noise["score"][order].sum(0)
        info = noise["info"][order].sum(0)
        ratio = noise["ratio"][order].sum(0)
        k = score.shape[0]
        ridge = 1e-9 * max(float(torch.diagonal(info).max()), 1.0)
        step = torch.linalg.solve(info + ridge * torch.eye(k, dtype=F64), score)
        norm = float(step.norm())
        if norm > MAX_STEP:
            step = step * (MAX_STEP / norm)
        fit = server["noise_gamma_fit"].to(F64) + step
        # BIC (Schwarz 1978) for k added parameters, rows as the samples of the noise model
        chosen = 2.0 * float(ratio) > k * math.log(max(float(rows), 2.0))
        return {
            "noise_gamma_fit": fit,
            "noise_gamma": fit.clone() if chosen else torch.zeros(k, dtype=F64),
            "noise_ratio": ratio,
        }
