"""New units against a stored fleet prior, in NumPy: each unit's posterior and predictive σ.

What ``calibrate``, ``plan``, ``predict`` and the exports need from a
:class:`~fedcal.prior.model.PriorModel`, without the training algorithm (and without
torch). The model (:mod:`fedcal.algorithms.fedprior`, "Model"):

    c ~ N(μ, Σ),   y = z(x)ᵀc + ε,   ε ~ N(0, σ_i²),   z = [φ(x), b·ψ(x)]

(φ, ψ: :mod:`fedcal.prior.legendre`; b the row's sweep sign, 0 when unknown). Per unit, with
G = ZᵀZ, r = Zᵀy over its rows and L = chol(Σ) (the whitened form of
:func:`fedcal.core.bayes.posterior`, the same operations):

    A = I + LᵀGL/σ_i²,   m = μ + L A⁻¹ Lᵀ(r − Gμ)/σ_i²,   V = L A⁻¹ Lᵀ,
    E‖y − Zc‖² = yᵀy − 2rᵀm + mᵀGm + tr(GV)                        (rss_i),
    σ_i² ← (rss_i + νσ²)/(n_i + ν)   (noise = "sensor": 25 fixed-point steps; "fleet": σ²).

A calibrated interval (fedprior "Intervals", I2–I4) adds τ² (``disc_var``) for units of the
probe's size, the rich units' own τ² otherwise, and declines a unit (no σ) by the fleet's
decline code, I3's weak directions, or a design smaller than any the fleet held out. The
predictive variance is z(x)ᵀQz(x) + s with Q = blockdiag(V_cc, m_h m_hᵀ + V_hh), s = σ_i² + τ²
(:func:`variance_form`); beyond the unit's support box (the prior's calibrated range widened
to its own rows) the prediction is the basis's tangent-plane continuation and the squared gap
to the polynomial is added (:func:`predictive_std`).

Covered: fedprior and its configured variants (fixed or selected basis, fleet or per-unit
noise, a direction term with pinned terms, a calibrated or posterior interval). Not covered
(:func:`unsupported` says which, and ``calibrate`` then takes the torch path): drift, the
time-respecting choice, noise over the inputs or Student-t rows. A prior's deployment
discrepancy model (issue 33) gives new units its σ (D2–D4, :mod:`fedcal.prior.deployment`).
Equal to the torch path within rounding: tests/prior/test_posterior.py,
tests/prior/test_torch_free.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from fedcal.data.fleet import Fleet
from fedcal.prior.deployment import deploy
from fedcal.prior.discrepancy import deployed_variance, smoother_q
from fedcal.prior.legendre import legendre_products, linearized_products
from fedcal.prior.model import PriorModel

NOISE_ITERATIONS = 25  # = fedcal.calibration.NOISE_ITERATIONS (tested equal)
NOISE_PRIOR_POINTS = 4.0  # ν: FedPrior.noise_prior_points's default (tested equal)
PROBE_ROWS = 32  # FedPrior.probe_rows's default (tested equal)
UNLEARNED_SHARE = 0.5  # = fedcal.core.identify.UNLEARNED_SHARE (tested equal)
JITTERS = (1e-12, 1e-10, 1e-8, 1e-6, 1e-4)  # = fedcal.core.bayes.JITTERS (tested equal)
DECLINED_NO_PROJECTOR = 5  # the decline code of a prior without I3's projector


def unsupported(prior: PriorModel, timed: bool = False) -> str:
    """Why the NumPy path does not cover ``prior`` ("" when it does; module docstring)."""
    params = prior.provenance.method_params
    if prior.drift is not None or prior.method == "fedprior_drift":
        return "a drift prior (fedprior_drift)"
    choose = params.get("choose", "off")
    if choose == "time" or (choose == "auto" and timed):
        return "the time-respecting choice (choose = time)"
    if prior.noise.gamma is not None or params.get("noise_shape", "constant") != "constant":
        return "noise over the inputs (noise_shape = inputs)"
    if prior.noise.student is not None or params.get("noise_tail", "gaussian") != "gaussian":
        return "Student-t rows (noise_tail)"
    return ""


def deploys(prior: PriorModel) -> bool:
    """Whether new units take the prior's deployment discrepancy model (issue 33:
    :mod:`fedcal.prior.deployment`): a discrepancy model and a calibrated interval."""
    params = prior.provenance.method_params
    return prior.discrepancy is not None and params.get("interval") == "calibrated"


@dataclass(frozen=True)
class Units:
    """Each unit's posterior under the prior, scaled units: ``coef`` (c, p), ``cov`` (c, p, p),
    ``noise_var`` σ_i² (c,), ``box`` its support (c, 2, inputs); with a calibrated interval
    ``disc_var`` τ_i² (c,) and ``declined`` (c,) bool (no σ stated); from a prior's
    deployment discrepancy model (:mod:`fedcal.prior.deployment`) ``gp`` its ``gp_*``
    leaves (each (c, ...)) and ``reasons`` per unit why its design gets no σ ("" if it
    gets one)."""

    coef: np.ndarray
    cov: np.ndarray
    noise_var: np.ndarray
    box: np.ndarray
    terms: tuple[tuple[int, ...], ...]
    branch_terms: tuple[tuple[int, ...], ...] = ()
    disc_var: np.ndarray | None = None
    declined: np.ndarray | None = None
    gp: dict[str, np.ndarray] | None = None
    reasons: tuple[str, ...] = ()

    def rows(self, start: int, stop: int) -> Units:
        """Units ``start`` … ``stop − 1`` (their arrays sliced; the basis kept)."""
        out = {
            k: (v[start:stop] if isinstance(v, np.ndarray) else v) for k, v in self.__dict__.items()
        }
        if self.gp is not None:
            out["gp"] = {k: v[start:stop] for k, v in self.gp.items()}
        out["reasons"] = self.reasons[start:stop]
        return Units(**out)


def design(prior: PriorModel, x: np.ndarray, branch: np.ndarray | None = None) -> np.ndarray:
    """[φ(x), b·ψ(x)] (..., rows, p); ``branch`` None reads as b = 0."""
    phi = legendre_products(x, prior.basis.terms)
    if not prior.basis.branch_terms:
        return phi
    psi = legendre_products(x, prior.basis.branch_terms)
    b = np.zeros(x.shape[:-1]) if branch is None else np.asarray(branch, dtype=np.float64)
    return np.concatenate([phi, psi * b[..., None]], -1)


def safe_cholesky(a: np.ndarray) -> np.ndarray:
    """:func:`fedcal.core.bayes.safe_cholesky` for one symmetric matrix or a batch: the factor,
    with the smallest relative jitter of :data:`JITTERS` that factors, else an eigenvalue floor
    at 10⁻⁴·λ_max."""
    a = 0.5 * (a + np.swapaxes(a, -1, -2))
    if a.ndim > 2:
        return np.stack([safe_cholesky(m) for m in a]) if len(a) else a.copy()
    try:
        return np.linalg.cholesky(a)
    except np.linalg.LinAlgError:
        pass
    if not np.isfinite(a).all():
        a = np.eye(len(a))
    eye = np.eye(len(a))
    scale = max(np.abs(np.diag(a)).max(), 1e-300)
    for eps in JITTERS:
        try:
            return np.linalg.cholesky(a + eps * scale * eye)
        except np.linalg.LinAlgError:
            continue
    vals, vecs = np.linalg.eigh(a)
    vals = np.maximum(vals, 1e-4 * max(vals.max(), 1e-300))
    floored = (vecs * vals[..., None, :]) @ vecs.T
    return np.linalg.cholesky(0.5 * (floored + floored.T))


def _chol_all(a: np.ndarray) -> np.ndarray:
    """Batched Cholesky; a batch with a matrix that does not factor goes one by one."""
    try:
        return np.linalg.cholesky(0.5 * (a + np.swapaxes(a, -1, -2)))
    except np.linalg.LinAlgError:
        return safe_cholesky(a)


def posterior(
    gram: np.ndarray, rhs: np.ndarray, yy: np.ndarray, mu: np.ndarray, sigma: np.ndarray,
    noise: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """(m, V, rss) per unit (module docstring): ``gram`` (c, p, p), ``rhs`` (c, p), ``yy`` (c,),
    prior ``mu`` (p,), ``sigma`` (p, p), ``noise`` σ_i² (c,)."""
    c, p = rhs.shape
    chol = safe_cholesky(sigma)
    s2 = noise.reshape(c, 1, 1)
    lg = chol.T @ gram @ chol / s2
    a = np.eye(p) + 0.5 * (lg + np.swapaxes(lg, -1, -2))
    a_chol = _chol_all(a)
    eye = np.broadcast_to(np.eye(p), a.shape)
    a_chol_inv = np.linalg.solve(a_chol, eye)  # triangular: L_A⁻¹
    a_inv = np.swapaxes(a_chol_inv, -1, -2) @ a_chol_inv
    g = (chol.T @ (rhs - (gram @ mu[:, None])[..., 0])[..., None]) / s2
    z = a_inv @ g
    mean = mu + (chol @ z)[..., 0]
    cov = chol @ a_inv @ chol.T
    cov = 0.5 * (cov + np.swapaxes(cov, -1, -2))
    col = mean[..., None]
    rss = (
        yy
        - 2 * (rhs * mean).sum(-1)
        + (np.swapaxes(col, -1, -2) @ gram @ col)[..., 0, 0]
        + (gram * cov).sum((-2, -1))
    )
    return mean, cov, np.maximum(rss, 0.0)


def _model_mask(prior: PriorModel) -> np.ndarray | None:
    """1 on the terms in the model, 0 on the pinned direction terms (None: all in)."""
    basis = prior.basis
    if not basis.pinned:
        return None
    pinned = [0.0] * len(basis.terms) + [float(t in basis.pinned) for t in basis.branch_terms]
    return 1.0 - np.array(pinned)


def calibrate_units(
    prior: PriorModel,
    x: np.ndarray,
    y: np.ndarray,
    mask: np.ndarray,
    branch: np.ndarray | None = None,
    noise_var: float | None = None,
) -> Units:
    """Each unit's posterior under ``prior`` (module docstring) from its padded rows:
    ``x`` (c, rows, inputs) and ``y`` (c, rows) scaled by the prior's scaler, ``mask``
    (c, rows) 1 on real rows, ``branch`` (c, rows) sweep signs or None. ``noise_var``:
    the planner's σ² for every unit (None: each unit's own, module docstring)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    w = np.asarray(mask, dtype=np.float64)
    c = x.shape[0]
    zed = design(prior, x, branch) * w[..., None]
    yw = y * w
    gram, rhs, yy, n = (
        np.swapaxes(zed, 1, 2) @ zed,
        (zed * yw[..., None]).sum(1),
        (yw * yw).sum(1),
        w.sum(1),
    )
    m = _model_mask(prior)
    if m is not None:
        gram, rhs = gram * m[:, None] * m[None, :], rhs * m
    mu, sigma, fleet = prior.mean, prior.covariance, prior.noise.variance
    noise = np.full(c, fleet if noise_var is None else float(noise_var))
    kind = prior.noise.kind or prior.provenance.method_params.get("noise", "fleet")  # v1 files
    if noise_var is None and kind == "sensor":
        nu = prior.provenance.method_params.get("noise_prior_points", NOISE_PRIOR_POINTS)
        for _ in range(NOISE_ITERATIONS):
            rss = posterior(gram, rhs, yy, mu, sigma, noise)[2]
            noise = (rss + nu * fleet) / (n + nu)
    coef, cov, _ = posterior(gram, rhs, yy, mu, sigma, noise)
    if m is not None:
        coef, cov = coef * m, cov * m[:, None] * m[None, :]
    units = Units(
        coef, cov, noise, _unit_box(prior, x, w), prior.basis.terms, prior.basis.branch_terms
    )
    if prior.interval is None:
        return units
    units = _with_interval(prior, units, x, w, n)
    if not deploys(prior):
        return units
    weak = weak_units(prior, units.cov, units.noise_var, x, w)
    gp, disc, declined, why = deploy(prior, units, (x, y * w, w, zed), weak, m)
    return replace(units, gp=gp, disc_var=disc, declined=declined, reasons=why)


def _unit_box(prior: PriorModel, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """(c, 2, inputs): the prior's calibrated range (scaled) widened to each unit's rows."""
    span = np.array([prior.input_range[col] for col in prior.features], dtype=float).T
    fleet = prior.scaler.x(span)
    real = w[..., None] > 0
    lo = np.where(real, x, np.inf).min(1)
    hi = np.where(real, x, -np.inf).max(1)
    return np.stack([np.minimum(lo, fleet[0]), np.maximum(hi, fleet[1])], 1)


def _with_interval(
    prior: PriorModel, units: Units, x: np.ndarray, w: np.ndarray, n: np.ndarray
) -> Units:
    """τ_i² and the declined units of a calibrated interval (FedPrior._personal, I2–I4)."""
    iv = prior.interval
    probe, code = float(iv.probe_rows), float(iv.declined)
    small = n < 2 * probe
    rows = prior.provenance.method_params.get("probe_rows", PROBE_ROWS)
    unknown = (n < probe) | ((probe == 0) & (n <= rows))
    own = 0.0
    if iv.has_own:
        own = np.nan if iv.discrepancy_var_own is None else float(iv.discrepancy_var_own)
    rich = np.nan_to_num(np.float64(own), nan=0.0)
    disc = np.where(small, iv.discrepancy_var, rich)
    lost = ~small & np.isnan(own) & (probe > 0)
    weak = weak_units(prior, units.cov, units.noise_var, x, w)
    declined = (code == 1) | weak | (small & (code > 1) & (code != 5)) | unknown | lost
    return Units(**{**units.__dict__, "disc_var": disc, "declined": declined})


def weak_units(
    prior: PriorModel, cov: np.ndarray, noise: np.ndarray, x: np.ndarray, w: np.ndarray
) -> np.ndarray:
    """(c,) bool: I3 (FedPrior.weak_units): the weakly identified directions carry more than
    :data:`UNLEARNED_SHARE` of a unit's predictive variance at the midpoints of its
    consecutive rows (its one row if it has one)."""
    c = x.shape[0]
    proj = prior.interval.weak_projector
    if proj is None:
        return np.full(c, prior.interval.declined == DECLINED_NO_PROJECTOR)
    if not (proj != 0).any():
        return np.zeros(c, dtype=bool)
    if x.shape[1] > 1:
        pair = w[:, :-1] * w[:, 1:]
        one = (w.sum(1) == 1).astype(float)[:, None]
        x = np.concatenate([0.5 * (x[:, :-1] + x[:, 1:]), x[:, :1]], 1)
        w = np.concatenate([pair, one * w[:, :1]], 1)
    p = len(prior.basis.terms)
    phi = legendre_products(x, prior.basis.terms)
    return unlearned_share(phi, cov[..., :p, :p], noise, proj[:p, :p], w) > UNLEARNED_SHARE


def unlearned_share(
    phi: np.ndarray, cov: np.ndarray, noise: np.ndarray, weak: np.ndarray, mask: np.ndarray
) -> np.ndarray:
    """:func:`fedcal.core.identify.unlearned_share`: Σ (φᵀVW)(WᵀVW)⁺(WᵀVφ) / Σ (φᵀVφ + σ²)."""
    finite = np.isfinite(cov).reshape(len(cov), -1).all(1) & np.isfinite(noise)
    safe = np.where(finite[:, None, None], cov, 0.0)
    cross = phi @ (safe @ weak)
    inner = weak.T @ safe @ weak
    inv = np.linalg.pinv(0.5 * (inner + np.swapaxes(inner, -1, -2)), rcond=1e-12, hermitian=True)
    along = ((cross @ inv) * cross).sum(-1)
    total = ((phi @ safe) * phi).sum(-1) + np.where(finite, noise, 1.0)[:, None]
    share = (along * mask).sum(1) / np.maximum((total * mask).sum(1), 1e-300)
    return np.where(finite, share, np.nan)


def predict(units: Units, x: np.ndarray) -> np.ndarray:
    """ψ(x)ᵀm_c per row (c, rows): the guarded basis (module docstring); with a direction
    term the branch average (b unknown in use)."""
    p = len(units.terms)
    phi, _ = _guarded(units, x)
    return (phi * units.coef[:, None, :p]).sum(-1)


def _guarded(units: Units, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    box = units.box
    return linearized_products(x, units.terms, box[:, None, 0], box[:, None, 1])


def variance_form(units: Units) -> tuple[np.ndarray, np.ndarray]:
    """(Q, s): the predictive variance z(x)ᵀQz(x) + s, z = [φ, ψ] (module docstring); s NaN
    for a declined unit."""
    p = len(units.terms)
    q = np.zeros_like(units.cov)
    q[..., :p, :p] = units.cov[..., :p, :p]
    if units.branch_terms:
        m_h = units.coef[..., p:]
        q[..., p:, p:] = m_h[..., :, None] * m_h[..., None, :] + units.cov[..., p:, p:]
    s = np.zeros(len(units.coef)) + units.noise_var
    if units.disc_var is not None:
        s = s + units.disc_var
    if units.declined is not None:
        s = np.where(units.declined, np.nan, s)
    return q, s


def variance_design(units: Units, x: np.ndarray) -> np.ndarray:
    """z(x) = [φ(x), ψ(x)]: no sign b (unknown in use)."""
    phi = legendre_products(x, units.terms)
    if not units.branch_terms:
        return phi
    return np.concatenate([phi, legendre_products(x, units.branch_terms)], -1)


def predictive_std(units: Units, x: np.ndarray) -> np.ndarray:
    """σ(x) per row (c, rows), scaled: √(zᵀQz + s [+ gap²] ) (module docstring)."""
    q, s = variance_form(units)
    z = variance_design(units, x)
    var = ((z @ q) * z).sum(-1) + s[:, None]
    if units.gp is not None:  # the prior's deployment discrepancy model (D2–D4)
        var = _deployed_var(units, x, var)
    phi, beyond = _guarded(units, x)
    if beyond.any():
        p = len(units.terms)
        gap = ((legendre_products(x, units.terms) - phi) * units.coef[:, None, :p]).sum(-1)
        var = var + np.where(beyond, gap * gap, 0.0)
    return np.sqrt(var)


def _deployed_var(units: Units, x: np.ndarray, var: np.ndarray) -> np.ndarray:
    """D2–D4 at query rows ``x`` (c, rows, d) (:func:`fedcal.prior.discrepancy.deployed_variance`,
    the torch path's :func:`~fedcal.algorithms.fedprior_deployed.deployed_var`)."""
    gp = units.gp
    phi = legendre_products(x, units.terms)
    q = smoother_q(x, phi, gp["gp_x"], gp["gp_mask"], gp["gp_a"], gp["gp_len"][:, None, :])
    col = [a.reshape(-1, 1) for a in (units.noise_var, gp["gp_beta"], gp["gp_amp"], gp["gp_scale"])]
    return deployed_variance(var, *col[:3], q, col[3])


Z95 = 1.959964  # = FedPrior.interval_halfwidth's Gaussian 95 % point (tested equal)
BISECTIONS = 60  # = fedcal.core.bayes.mixture_halfwidth's halvings


def mixture_halfwidth(shift: np.ndarray, sd: np.ndarray, level: float = 0.95) -> np.ndarray:
    """:func:`fedcal.core.bayes.mixture_halfwidth` in NumPy: w with P(|e| ≤ w) = ``level``,
    e ~ ½N(m, s²) + ½N(−m, s²), by bisection on [0, |m| + 6s]; NaN in either input: NaN."""
    from scipy.special import ndtr

    m, s = np.abs(shift), np.maximum(sd, 1e-300)

    def mass(w: np.ndarray) -> np.ndarray:
        inner = ndtr((w - m) / s) - ndtr((-w - m) / s)
        return 0.5 * (inner + ndtr((w + m) / s) - ndtr((-w + m) / s))

    lo, hi = np.zeros_like(m), m + 6.0 * s
    for _ in range(BISECTIONS):
        mid = 0.5 * (lo + hi)
        low = mass(mid) < level
        lo, hi = np.where(low, mid, lo), np.where(low, hi, mid)
    return np.where(np.isnan(shift) | np.isnan(sd), np.nan, 0.5 * (lo + hi))


def interval_halfwidth(units: Units, x: np.ndarray, std: np.ndarray | None = None) -> np.ndarray:
    """The stated 95 % interval's half-width per row (c, rows), scaled
    (:meth:`fedcal.algorithms.fedprior.FedPrior.interval_halfwidth`): 1.96 σ; with a direction
    term the sweep mixture's, ½N(ψᵀm_h, s²) + ½N(−ψᵀm_h, s²), s² = σ² − (ψᵀm_h)²."""
    std = predictive_std(units, x) if std is None else std
    if not units.branch_terms:
        return Z95 * std
    p = len(units.terms)
    m = (legendre_products(x, units.branch_terms) * units.coef[:, None, p:]).sum(-1)
    return mixture_halfwidth(m, np.sqrt(np.maximum(std * std - m * m, 0.0)))


def padded_rows(
    prior: PriorModel, fleet: Fleet, split: str = "train"
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """(x, y, mask, branch) of ``fleet``'s ``split`` rows scaled by the prior's scaler, padded
    per unit at the end as :meth:`fedcal.core.data.ClientData.from_arrays` pads them (unit
    order: ``fleet.client_ids``); ``branch`` None without a direction term in the prior."""
    arrays = fleet.arrays(split)
    signs = fleet.branch_signs(split) if prior.basis.branch_terms else None
    rows = max(max((len(xi) for xi, _ in arrays), default=0), 1)
    c = len(arrays)
    x, y = np.zeros((c, rows, len(prior.features))), np.zeros((c, rows))
    mask = np.zeros((c, rows))
    branch = None if not prior.basis.branch_terms else np.zeros((c, rows))
    for i, (xi, yi) in enumerate(arrays):
        k = len(xi)
        x[i, :k], y[i, :k], mask[i, :k] = prior.scaler.x(xi), prior.scaler.y(yi)[:, 0], 1.0
        if branch is not None and signs is not None:
            branch[i, :k] = signs[i]
    return x, y, mask, branch
