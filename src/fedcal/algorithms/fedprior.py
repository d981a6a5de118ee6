"""Fleet-prior calibration: federated empirical Bayes over per-sensor coefficients (ours).

Units of one design differ, but not arbitrarily: their calibration
coefficients vary around a fleet mean along a few directions. The federation
learns that distribution without pooling anyone's data, and a unit with a
handful of chamber points is calibrated by placing itself in it
(empirical Bayes; docs/calibration-guide.md). The model is linear in its parameters:

    y_i = φ(x)ᵀ c_i + ε,   ε ~ N(0, σ_i²),   c_i ~ N(μ, Σ),

with φ a Legendre-product basis of the scaled inputs (:func:`legendre_products`):
the tensor product up to ``orders`` for a two-input pressure sensor (the
inputs are scaled by their fixed physical ranges), or every product up to a
total ``degree`` for any other set of named features.

One round is one ECME iteration (:mod:`fedcal.core.bayes`):

1. **E-step, client i** (closed form, float64): from its moments
   (Φ_iᵀΦ_i, Φ_iᵀy_i, y_iᵀy_i, n_i) and the broadcast (μ, Σ, σ²), the posterior
   N(m_i, V_i) of its coefficients. It uploads only what the server's sums
   need: m_i, S_i = m_i m_iᵀ + V_i, the GLS terms Φ_iᵀC_i⁻¹Φ_i and
   Φ_iᵀC_i⁻¹(y_i − Φ_iμ), its expected residual sum of squares r_i, n_i, and how
   far its own points determine each direction (for the identification check).
   With ``noise = "sensor"`` (for fleets whose units differ in noise) it keeps
   a private noise variance
   σ_i² = (r_i + ν σ²)/(n_i + ν): its own residuals shrunk toward the fleet's by
   ν pseudo-points (the MAP under a scaled-inverse-χ² prior centred on σ²), so a
   noisy unit is not trusted like a clean one and a unit with three points is
   not trusted on its own noise.
2. **M-step, server**: μ by generalized least squares, Σ by EM's update
   (1/N) Σ_i E[(c_i − μ)(c_i − μ)ᵀ], then shrunk toward its diagonal by
   ``shrinkage``, optionally factored as ``rank`` factors plus a diagonal, and
   its eigenvalues floored (:func:`fedcal.core.bayes.regularize`);
   σ² = Σ_i r_i / Σ_i n_i (with ``interval = "calibrated"``: on residual degrees of
   freedom, I1 below). Only sums over clients enter, in a canonical order.
3. **Personal model** (``personalize``): the posterior mean m_i, which is a
   precision-weighted interpolation between the unit's own least-squares fit
   and the fleet mean, with its covariance V_i: every prediction carries the
   predictive variance φ(x)ᵀV_iφ(x) + σ_i² (:meth:`FedPrior.predictive_std`).

Identification. A direction of coefficient space that no unit's data
determine (e.g. curvature in temperature when every unit saw only two
temperatures) cannot be learned. The server counts, per direction of the
basis, how many units' own points determine it (the eigenvalues of
Σ_i [I − (I + s²G_i/σ_i²)⁻¹], s = ``init_scale``); along directions informed by
fewer than ``min_informed`` units it keeps the vague start (μ unchanged,
variance s²) instead of an estimate from one or two units, so predictions
that lean on them carry a wide predictive σ rather than a confident number,
and the run reports them as weakly identified (:meth:`FedPrior.identification`,
in the run's output and the exported prior). When every unit has fewer points
than the basis has terms, lower the orders: the prior cannot be learned from
such a fleet (measured in docs/results/fleet-prior.md).

Complexity from the fleet's evidence (``select = "bic"``). The orders are an
upper bound; every sub-basis (each input's order 0..its bound; for a
total-degree basis every degree 0..``degree``) is a candidate, and all
candidates' EM runs in the same federation: a client's E-step is repeated per
candidate on its moments restricted to that candidate's terms (exactly the
sub-basis model; the other coefficients see no data), and it uploads each
candidate's statistics and log-evidence log p(y_i | μ_k, Σ_k, σ_k²). The
server updates every candidate and keeps the one of highest BIC (Schwarz 1978)
of the fleet's summed evidence,

    BIC_k = Σ_i log p(y_i | θ_k) − ½ d_k log N,   d_k = p_k + p_k(p_k + 1)/2 + 1

(μ, full Σ, σ²; N units), as the model every unit uses and exports. A fleet
whose units all have few points cannot learn a large prior and gets a smaller
basis; a fleet with calibrated units keeps a rich one. The server's screening
judges a client by the chosen candidate's statistics only
(``unscreened_replies``): a misfitting candidate has large statistics for
honest units, and judging by them rejected honest units (measured: a mixed
3×2 fleet fell to 7.9 hPa). A client rejected by that test is left out of
every candidate's sums.

The chamber's sweep direction (``branch_orders``, issue 10). A unit with
hysteresis reads differently on an ascending and a descending sweep, and the
chamber knows which it ran (the data's ``direction`` column, a sign b = +1 up,
−1 down, 0 unknown per row: :attr:`fedcal.core.data.ClientData.branch`). With
``branch_orders`` set, each unit's model gains a branch term

    y = φ(x)ᵀc_i + b·ψ(x)ᵀh_i + ε,   (c_i, h_i) ~ N(μ, Σ) jointly,

ψ the Legendre products up to ``branch_orders``: the design is [φ(x), b·ψ(x)]
and every step above runs on it unchanged. Units calibrated up and down teach
the fleet the mean and spread of h and its correlation with c; a unit swept one
way sees only c + h along ψ, and the joint prior splits the two. In the field
the direction is unknown (±1 with equal odds, E[b] = 0, E[b²] = 1), so the
prediction is the branch average and the hysteresis widens the interval:

    ŷ = φ(x)ᵀm_c,   Var = φ(x)ᵀV_cc φ(x) + σ² + ψ(x)ᵀ(m_h m_hᵀ + V_hh)ψ(x).

Rows without a direction (b = 0) carry no branch term (today's model). With
``select = "bic"`` the candidates are φ's sub-bases; ψ is in every candidate,
unless ``branch_select``: then the candidates are φ's sub-bases × ψ's options
(no term, or any orders vector ≤ ``branch_orders``), and the fleet's BIC also
decides whether and which direction term the data support (a fleet without
directions gets none: its ψ columns are empty, same evidence, more parameters).
Measured by helper "hyst" (studies/fewpoint_direction.py) and here
(docs/results/sweep-direction.md).

Field networks (issue 26). ``basis = "auto"`` is the tensor basis of ``orders`` for the
barometer's (frequency, temperature) and, for any other named features, the total-degree
basis (the build sets it: :func:`fedcal.build._generic_basis`), its degree chosen by the
fleet's BIC among 0..``degree`` under ``select = "bic"``. A basis of more than
:data:`~fedcal.models.basis.MAX_TERMS` terms is refused in one line. Every Cholesky
factorization goes through :func:`~fedcal.core.bayes.safe_cholesky` (jitter, then an
eigenvalue floor, reported per unit and round as the ``jitter`` metric and in one printed
line), so a near-singular Gram (collinear features, thousands of rows, σ² → 0) cannot end
the run. Extrapolation guard: the server keeps the fleet's input support, each input's
mean ± :data:`~fedcal.models.basis.SUPPORT_STDS` standard deviations from the summed Gram
(:meth:`FedPrior._input_box`), widened per unit to its own training range; beyond it the
prediction is ψ(x)ᵀm with ψ the basis continued along its tangent plane at the nearest
point of the box (:func:`~fedcal.models.basis.linearized_products`): linear growth, not
the d-th power. The predictive variance there is φᵀVφ + σ² + (φ(x)ᵀm − ψ(x)ᵀm)²: the
posterior term on the unguarded basis (wider than ψᵀVψ: the coefficients' uncertainty is
not linearized away, and the firmware export evaluates one form) and a one-σ model-form
allowance (what the polynomial and its linearization disagree by); such rows are
flagged (:meth:`FedPrior.beyond_support`, ``beyond_support`` in
per_sensor.csv and the summary).

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
    or Σ ν < 1, or the basis in use has weakly identified directions (see
    Identification; for every unit then), the run states no interval for those units —
    :meth:`predictive_std` is NaN there, coverage is empty, the prediction stands —
    and says why in one line (:meth:`interval_note`, ``prior.json``'s
    ``interval.reason``, the summary's ``coverage_note``). A unit calibrated later
    from ``prior.json`` (``fedcal calibrate``) gets the same τ² by the same rule,
    and none (declined) if it has fewer rows than the probe (or the fleet had no
    unit of at most ``probe_rows`` rows): its model error was never learned.

Defaults (ours, measured on mixed fleets of 20 fully calibrated + 20 new
units, 3 fleet seeds, off-grid test points; docs/results/): Legendre orders (4, 3),
the silicon-resonator calibration surface of docs/simulated-fleet.md,
which also spans a quartz unit to the noise floor — (3, 3) gives the same
errors, so the prior does not overfit the larger basis; ``select = "none"``
here, ``"bic"`` in the shipped configuration (it picks (3, 3) on the mixed
fleets, and (2, 2)/(2, 3) on fleets of 12-point units where (4, 3) fails); no shrinkage (0.05
toward the diagonal cost 15 % at 4×3 points: neighbouring Legendre terms of
one unit's narrow frequency span are strongly correlated, and shrinking
toward the diagonal discards what the fleet measured — EM's Σ stays positive
definite without it, through the posterior covariances V_i); a floor of
1e-12 on Σ's eigenvalues (absolute, scaled units); one fleet noise level
(per-sensor levels narrowed the intervals of units with few points:
coverage 0.78 against 0.88); a vague start
(coefficients ±1, noise 0.1 in scaled units) that keeps round 0
well-conditioned; 50 rounds of the engine are enough (EM's slowest rate is
the fraction of units that cannot see a direction).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.bayes import (
    F64,
    Moments,
    Posterior,
    data_support,
    m_step,
    moments,
    posterior,
    predictive_var,
    regularize,
    safe_cholesky,
)
from fedcal.core.data import ClientData
from fedcal.core.privacy import Statistic
from fedcal.core.tree import Tree
from fedcal.models.basis import (
    SUPPORT_STDS,
    any_beyond,
    legendre_exponents,
    legendre_products,
    linearized_products,
    orders_by_size,
)

WEAK_SHARE = 0.5  # a unit is "weak" when weak directions carry more of its σ² (client_status)


@dataclass(frozen=True)
class FedPrior(Algorithm):
    @property
    def uses_local_epochs(self) -> bool:  # closed form (EM)
        return False

    orders: tuple[int, ...] = (4, 3)  # tensor basis: highest Legendre order per input
    # "tensor" (orders), "total" (degree), "auto": tensor if orders fit
    basis: Literal["auto", "tensor", "total"] = "auto"
    degree: int = 2  # total-degree basis: every product of total order ≤ degree
    shrinkage_units: float = 2.0  # ν0: Σ ← (1 − λ)Σ̂ + λ diag(Σ̂), λ = ν0/(N + ν0)
    rank: int = 0  # > 0: Σ = W Wᵀ + D with this many factors; 0: full Σ
    floor: float = 1e-12  # eigenvalues of Σ ≥ floor (scaled units²)
    # "fleet": one σ²; "sensor": σ_i² shrunk toward the fleet's
    noise: Literal["fleet", "sensor"] = "fleet"
    noise_prior_points: float = 4.0  # ν of the per-sensor noise
    init_scale: float = 1.0  # prior std of every coefficient before any data (scaled units)
    init_noise: float = 0.1  # noise std before any data (scaled units)
    mean_scale: float = 10.0  # hyperprior N(0, s²) on μ (scaled units; inf: none)
    min_informed: float = 2.0  # a direction informed by fewer units is weakly identified
    # "bic": the sub-basis of highest fleet evidence (BIC); "none": all
    select: Literal["none", "bic"] = "none"
    dp_max_rows: float = 384.0  # client-level DP: rows a unit may hold (public; the campaign)
    branch_orders: tuple[int, ...] = ()  # ψ: Legendre orders per input of b·ψ(x)ᵀh; () = off
    # With select = "bic" and branch_orders: ψ chosen too, among no term and every orders
    # vector ≤ branch_orders (candidates = φ's sub-bases × these); False: ψ in every candidate.
    branch_select: bool = False
    # "posterior": φᵀVφ + σ², σ² = Σr/Σn (the model's own interval); "calibrated": σ² on residual
    # degrees of freedom, + a discrepancy variance learned by design-matched hold-out, or no
    # interval where the fleet cannot learn one (module doc, "Intervals").
    interval: Literal["posterior", "calibrated"] = "posterior"
    probe_rows: int = 32  # a unit with at most this many rows may be the hold-out's probe design
    coverage_target: float = 0.95  # τ² is the smallest that covers this share of held-out rows

    name = "fedprior"
    # m_i is the unit's posterior mean (its calibration); the rest are sufficient statistics.
    uploads = ("model", "statistics")

    reply_aggregation = "sum"  # sums of per-unit sufficient statistics
    # Measured (studies/poisoning.py): a coordinate-wise median of the second moments
    # is not positive definite (Cholesky fails) and a trimmed mean costs 24× on a clean
    # fleet; screening, clipping and Krum keep the statistics whole.
    robust_rules = ("mean", "krum")
    # With select = "bic" every candidate's statistics travel under "cand/"; the server
    # judges a client (screening, Krum) by the chosen candidate's statistics only: a
    # sub-basis that misfits the fleet has large statistics for honest units too.
    unscreened_replies = ("cand/", "interval/")

    def __post_init__(self) -> None:
        object.__setattr__(self, "orders", tuple(int(o) for o in self.orders))
        object.__setattr__(self, "branch_orders", tuple(int(o) for o in self.branch_orders))
        if self.shrinkage_units < 0:
            raise ValueError(f"shrinkage_units must be >= 0, got {self.shrinkage_units}")
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")
        if not (self.floor > 0 and self.init_scale > 0 and self.init_noise > 0):
            raise ValueError("floor, init_scale and init_noise must be > 0")
        if self.probe_rows < 1:
            raise ValueError(f"probe_rows must be >= 1, got {self.probe_rows}")
        if self.noise_prior_points <= 0:
            raise ValueError(f"noise_prior_points must be > 0, got {self.noise_prior_points}")
        self.terms  # noqa: B018 — validate the basis against the model's inputs now
        if self.branch_orders and (
            len(self.branch_orders) != self.num_inputs or min(self.branch_orders) < 0
        ):
            raise ValueError(
                f"branch_orders {list(self.branch_orders)} needs one order >= 0 per input "
                f"({self.num_inputs} inputs), or [] for no direction term"
            )

    # ---- the basis ---------------------------------------------------------
    @property
    def num_inputs(self) -> int:
        return int(getattr(self.task.model, "in_features", 2))

    def _tensor_basis(self) -> bool:
        f = self.num_inputs
        return self.basis == "tensor" or (self.basis == "auto" and len(self.orders) == f)

    @cached_property  # built once per instance: the fields are frozen
    def terms(self) -> tuple[tuple[int, ...], ...]:
        """Exponent tuples of the basis functions (constant first)."""
        f = self.num_inputs
        if self._tensor_basis():
            if len(self.orders) != f:
                raise ValueError(
                    f"orders {list(self.orders)} needs one order per input ({f} inputs); "
                    "or use basis = 'total' with a degree"
                )
            return legendre_exponents(f, orders=self.orders)
        return legendre_exponents(f, degree=self.degree)

    @cached_property
    def branch_terms(self) -> tuple[tuple[int, ...], ...]:
        """Exponent tuples of ψ, the direction term's basis (empty when off)."""
        if not self.branch_orders:
            return ()
        return legendre_exponents(self.num_inputs, orders=self.branch_orders)

    @property
    def num_features(self) -> int:
        """Columns of the design: φ's terms, then ψ's (the prior is over both)."""
        return len(self.terms) + len(self.branch_terms)

    def personal_shapes(self) -> dict[str, tuple[int, ...]]:
        """One sensor's :meth:`personalize` tree: shapes a loaded model file must have."""
        p = self.num_features
        # box: the unit's input support (lo, hi per input), the extrapolation guard's
        shapes = {"coef": (p,), "cov": (p, p), "noise_var": (), "box": (2, self.num_inputs)}
        if self.interval == "calibrated":  # τ_i² and whether the unit's interval is declined
            shapes.update(disc_var=(), declined=())
        return shapes

    @cached_property
    def candidates(self) -> tuple[dict[str, Any], ...]:
        """The bases ``select = "bic"`` chooses from, as parameter overrides, smallest first.

        Tensor basis: every orders vector ≤ ``orders`` (each input 0..its order);
        total-degree basis: every degree 0..``degree``. Each is a sub-basis of
        :attr:`terms`. ``select = "none"``: the basis itself only.
        """
        if self.select == "none":
            return ({},)
        if self._tensor_basis():
            out = [{"orders": list(o)} for o in orders_by_size(self.orders)]
        else:
            out = [{"degree": d} for d in range(self.degree + 1)]
        if not (self.branch_select and self.branch_orders):
            return tuple(out)
        # ψ options: none, then every orders vector ≤ branch_orders, smallest first; the
        # product with φ's candidates is ordered by total size (ties: φ's order, then ψ's).
        psi = [[], *(list(o) for o in orders_by_size(self.branch_orders))]
        size = [len(self.candidate_terms(c)) for c in out]
        both = [
            (size[i] + (math.prod(a + 1 for a in b) if b else 0), i, j)
            for i in range(len(out))
            for j, b in enumerate(psi)
        ]
        return tuple({**out[i], "branch_orders": psi[j]} for _, i, j in sorted(both))

    def candidate_branch_terms(self, candidate: dict[str, Any]) -> tuple[tuple[int, ...], ...]:
        """ψ's terms of one candidate (all of :attr:`branch_terms` unless ψ is selected)."""
        if "branch_orders" not in candidate:
            return self.branch_terms
        if not candidate["branch_orders"]:
            return ()
        return legendre_exponents(self.num_inputs, orders=candidate["branch_orders"])

    def candidate_terms(self, candidate: dict[str, Any]) -> tuple[tuple[int, ...], ...]:
        """The terms of one candidate, in its own basis order (constant first)."""
        if "orders" not in candidate and "degree" not in candidate:
            return self.terms
        if "orders" in candidate:
            return legendre_exponents(self.num_inputs, orders=candidate["orders"])
        return legendre_exponents(self.num_inputs, degree=candidate["degree"])

    @cached_property
    def masks(self) -> Tensor:
        """(candidates, features): 1 where a candidate's basis holds a term of :attr:`terms`.

        The direction term's ψ columns are in every candidate, unless ψ is selected
        (``branch_select``): then those of the candidate's ψ.
        """
        q = len(self.branch_terms)
        out = torch.ones(len(self.candidates), len(self.terms) + q, dtype=F64)
        for k, cand in enumerate(self.candidates):
            keep = set(self.candidate_terms(cand))
            out[k, : len(self.terms)] = torch.tensor(
                [float(t in keep) for t in self.terms], dtype=F64
            )
            keep_psi = set(self.candidate_branch_terms(cand))
            out[k, len(self.terms) :] = torch.tensor(
                [float(t in keep_psi) for t in self.branch_terms], dtype=F64
            )
        return out

    def design(self, x: Tensor, branch: Tensor | None = None) -> Tensor:
        """[φ(x), b·ψ(x)]: (clients, rows, inputs) → (clients, rows, features), float64.

        ``branch`` (clients, rows): each row's sweep sign b; None reads as 0 (no
        direction known). Without ``branch_orders``: φ(x) only.
        """
        phi = legendre_products(x, self.terms)
        if not self.branch_orders:
            return phi
        psi = legendre_products(x, self.branch_terms)
        b = torch.zeros(x.shape[:-1], dtype=F64) if branch is None else branch.to(F64)
        return torch.cat([phi, psi * b.unsqueeze(-1)], -1)

    # ---- the contract --------------------------------------------------------
    def server_init(self, params: Tree) -> Tree:
        p = self.num_features
        start = {
            "mu": torch.zeros(p, dtype=F64),
            "sigma": self.init_scale**2 * torch.eye(p, dtype=F64),
            "noise_var": torch.tensor(self.init_noise**2, dtype=F64),
            "support": torch.zeros(p, p, dtype=F64),
        }
        if self.interval == "calibrated":
            start.update(self._interval_init())
        if self.select == "none":
            return {**start, "box": self._open_box()}
        k = len(self.candidates)
        # Round 0 screens with the largest candidate (the basis asked for), as without selection.
        fleet_keys = ("mu", "sigma", "noise_var", "support")
        return {
            **start,
            "box": self._open_box(),
            "mask": self.masks[-1].clone(),
            "choice": torch.tensor(k - 1),
            "scores": torch.zeros(k, dtype=F64),
            "cand": {key: start[key].expand(k, *start[key].shape).clone() for key in fleet_keys},
        }

    def broadcast(self, server: Tree) -> Tree:
        down = {k: server[k] for k in ("mu", "sigma", "noise_var")}
        if "box" in server:  # the fleet's input support (extrapolation guard)
            down["box"] = server["box"]
        down.update({k: server[k] for k in INTERVAL_KEYS if k in server})
        if self.select != "none":
            down["mask"] = server["mask"]
            down["cand"] = {k: server["cand"][k] for k in ("mu", "sigma", "noise_var")}
        return down

    def client_init(self, down: Tree) -> Tree:
        state = {"noise_var": down["noise_var"].clone()}
        if self.select != "none":
            state["cand_noise_var"] = down["cand"]["noise_var"].clone()
        return state

    def _noise(self, down: Tree, state: Tree) -> Tensor:
        return state["noise_var"] if self.noise == "sensor" else down["noise_var"]

    def _moments(self, data: ClientData) -> Moments:
        """The unit's moments of the whole design [φ, b·ψ] (module doc, step 1)."""
        return moments(self.design(data.x, data.branch), data.y[..., 0], data.mask)

    def _posterior(self, down: Tree, state: Tree, full: Moments) -> tuple[Moments, Posterior]:
        """The posterior under the broadcast prior; with selection, the chosen candidate's."""
        stats = _masked(full, down["mask"]) if "mask" in down else full
        return stats, posterior(stats, down["mu"], down["sigma"], self._noise(down, state))

    def _sensor_noise(self, rss: Tensor, n: Tensor, fleet: Tensor) -> Tensor:
        """σ_i² = (r_i + ν σ²)/(n_i + ν): the MAP under a scaled-inv-χ²(ν, σ²) prior."""
        nu = self.noise_prior_points
        return (rss + nu * fleet) / (n + nu)

    def _client_moments(self, down: Tree, data: ClientData) -> Moments:
        """The moments the E-step uses (fedprior_drift whitens them by its drift)."""
        return self._moments(data)

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        full = self._client_moments(down, data)  # once: candidates' moments are masks of these
        # With selection the chosen candidate's E-step is also in the batch below, but is
        # computed on its own: with noise = "sensor" its σ_i² is last round's choice's (not
        # always this round's); with one fleet σ² the batched one differs in the last bits
        # (measured: taking it from the batch saved 4 % of a client update).
        stats, post = self._posterior(down, state, full)
        reml = full.n if self.interval == "calibrated" else None
        chosen = self._e_step_sums(post, stats.gram, self._noise(down, state), reml)
        # The reply's leaf order is part of its wire format (and of DP's noise draws).
        reply = {key: chosen[key] for key in ("mean", "second", "gls_gram", "gls_rhs", "rss")}
        reply.update(n=full.n, gram=full.gram, support=chosen["support"])
        if self.interval == "calibrated" and "probe_x" in down:
            # Unscreened ("interval/"): a unit's residual terms scale with its rows.
            reply["interval"] = {
                "dof": chosen["dof"],
                "fit": chosen["fit"],
                **self._heldout(down, state, data),
            }
        own = self._sensor_noise(post.rss, full.n, down["noise_var"])
        new_state = {"noise_var": own if self.noise == "sensor" else state["noise_var"]}
        if self.select != "none":
            reply["cand"], cand_own = self._candidates_e_step(down, state, full)
            new_state["cand_noise_var"] = (
                cand_own if self.noise == "sensor" else state["cand_noise_var"]
            )
        fit_mse = post.rss / full.n.clamp_min(1.0)
        # jitter: the relative jitter a near-singular factorization needed (0: none; 1: an
        # eigenvalue floor), per unit and round in the run's metrics (core.bayes.safe_cholesky).
        metrics = {"train_loss": fit_mse, "loglik": post.loglik, "jitter": post.jitter}
        return ClientResult(reply, new_state, metrics)

    def _e_step_sums(
        self, post: Posterior, gram: Tensor, noise: Tensor, n: Tensor | None = None
    ) -> Tree:
        """A unit's terms of the M-step sums (module doc, step 1): m_i, m_i m_iᵀ + V_i, the
        GLS terms, the expected RSS, its log-evidence and its data support."""
        return {
            "mean": post.mean,
            "second": post.mean.unsqueeze(-1) * post.mean.unsqueeze(-2) + post.cov,
            "gls_gram": post.gls_gram,
            "gls_rhs": post.gls_rhs,
            "rss": post.rss,
            "loglik": post.loglik,
            "support": data_support(gram, noise, self.init_scale),
            **({} if n is None else _residual_terms(post, gram, noise, n)),
        }

    def _candidates_e_step(self, down: Tree, state: Tree, full: Moments):
        """Every candidate's E-step at once: (clients, candidates, ...) statistics.

        Candidate k uses the moments ``full`` of its own terms (the others' rows and
        columns of G and b zeroed): its posterior, GLS terms and marginal likelihood
        log p(y_i | μ_k, Σ_k, σ_k²) are those of the sub-basis model exactly (the
        unused coordinates see no data and keep their prior).
        """
        masks = self.masks
        c, p = full.rhs.shape
        k = masks.shape[0]
        mm = masks.unsqueeze(0).expand(c, k, p)
        stats = Moments(
            (full.gram.unsqueeze(1) * mm.unsqueeze(-1) * mm.unsqueeze(-2)).reshape(c * k, p, p),
            (full.rhs.unsqueeze(1) * mm).reshape(c * k, p),
            full.yy.unsqueeze(1).expand(c, k).reshape(-1),
            full.n.unsqueeze(1).expand(c, k).reshape(-1),
        )
        cand = down["cand"]
        noise = state["cand_noise_var"] if self.noise == "sensor" else cand["noise_var"]
        noise = noise.reshape(-1)
        post = posterior(stats, cand["mu"].reshape(-1, p), cand["sigma"].reshape(-1, p, p), noise)
        out = self._e_step_sums(
            post, stats.gram, noise, stats.n if self.interval == "calibrated" else None
        )
        own = self._sensor_noise(post.rss, stats.n, cand["noise_var"].reshape(-1))
        return {key: v.reshape(c, k, *v.shape[1:]) for key, v in out.items()}, own.reshape(c, k)

    def _prior_update(
        self, old_mu: Tensor, total: dict, count: Tensor, metric: Tensor, old_noise: Tensor
    ):
        """One M-step from client sums: (μ, Σ, σ², support) (module doc, step 2)."""
        mu, sigma_hat = m_step(
            total["gls_gram"],
            total["gls_rhs"],
            total["mean"],
            total["second"],
            count,
            old_mu,
            self.mean_scale,
        )
        # λ = ν0/(N + ν0): ν0 pseudo-units of an inverse-Wishart hyperprior, so a small
        # fleet is shrunk more than a large one; in the fleet's design metric.
        lam = self.shrinkage_units / (float(count) + self.shrinkage_units)
        sigma = regularize(sigma_hat, lam, self.floor, self.rank or None, metric)
        # Directions that too few units' points determine are not learned: they keep the
        # vague start (μ as it was, variance init_scale²), so predictions that lean on
        # them carry a wide σ instead of a guess from one or two units (see module doc).
        vals, vecs = torch.linalg.eigh(0.5 * (total["support"] + total["support"].T))
        weak = vecs[:, vals < self.min_informed]
        if weak.shape[1]:
            proj_weak = weak @ weak.T
            proj_seen = torch.eye(mu.shape[0], dtype=F64) - proj_weak
            sigma = proj_seen @ sigma @ proj_seen + self.init_scale**2 * proj_weak
            mu = proj_seen @ mu + proj_weak @ old_mu
        noise_var = total["rss"] / total["n"].clamp_min(1.0)
        if "dof" in total:  # σ² = Σ‖y − Φm‖² / Σ(n − tr(GV)/σ²); none left: kept, declined
            dof = total["dof"]
            noise_var = torch.where(dof >= 1.0, total["fit"] / dof.clamp_min(1.0), old_noise)
        return mu, sigma, noise_var

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        # Every unit counts once (a hierarchical model's units are its samples);
        # sums in a canonical order so the rounding does not depend on arrival order.
        order = torch.from_numpy(np.lexsort(replies["mean"].numpy().T[::-1]).copy())
        total = {k: v[order].sum(0) for k, v in replies.items() if k not in ("cand", "interval")}
        if "interval" in replies:  # the restricted noise update's sums (module doc, I1)
            total.update({k: replies["interval"][k][order].sum(0) for k in ("dof", "fit")})
        count = torch.tensor(float(replies["mean"].shape[0]), dtype=F64)
        metric = total["gram"] / total["n"].clamp_min(1.0)
        if self.select == "none":
            mu, sigma, noise_var = self._prior_update(
                server["mu"], total, count, metric, server["noise_var"]
            )
            new = {"mu": mu, "sigma": sigma, "noise_var": noise_var, "support": total["support"]}
            new["box"] = self._input_box(total["gram"])
            return {**new, **self._interval_update(server, replies, order, total)}
        cand = {k: v[order].sum(0) for k, v in replies["cand"].items()}
        masks = self.masks
        new: dict[str, list[Tensor]] = {"mu": [], "sigma": [], "noise_var": []}
        for k in range(masks.shape[0]):
            part = {key: v[k] for key, v in cand.items()}
            part["n"] = total["n"]
            m = masks[k]
            out = self._prior_update(
                server["cand"]["mu"][k],
                part,
                count,
                metric * m.unsqueeze(0) * m.unsqueeze(1),
                server["cand"]["noise_var"][k],
            )
            for key, v in zip(("mu", "sigma", "noise_var"), out, strict=True):
                new[key].append(v)
        stacked = {key: torch.stack(v) for key, v in new.items()}
        stacked["support"] = cand["support"]
        # BIC of the fleet's evidence (Schwarz 1978): Σ_i log p(y_i | θ_k) − ½ d_k log N,
        # the evidence at the broadcast θ_k (each candidate's EM converges to its maximum).
        scores = cand["loglik"] - 0.5 * self._prior_parameters(masks) * math.log(float(count))
        choice = int(torch.argmax(scores))  # ties: the smaller candidate (listed first)
        return {
            **{key: v[choice] for key, v in stacked.items()},
            "box": self._input_box(total["gram"]),
            "mask": masks[choice],
            "choice": torch.tensor(choice),
            "scores": scores,
            "cand": stacked,
            **self._interval_update(server, replies, order, total),
        }

    def _prior_parameters(self, masks: Tensor) -> Tensor:
        """Free parameters d_k of each candidate's prior: μ (p), Σ (full or rank r + D), σ²."""
        p = masks.sum(1)
        if self.rank:
            r = torch.minimum(p, torch.tensor(float(self.rank), dtype=F64))
            cov = p * r - r * (r - 1) / 2 + p
        else:
            cov = p * (p + 1) / 2
        return p + cov + 1

    # ---- intervals that hold, or none (module doc, "Intervals") ----------------
    def _interval_init(self) -> Tree:
        zero = torch.tensor(0.0, dtype=F64)
        return {
            "probe_x": torch.zeros(self.probe_rows, self.num_inputs, dtype=F64),
            "probe_b": torch.zeros(self.probe_rows, dtype=F64),
            "probe_n": zero.clone(),  # rows of the probe design; 0: none (yet)
            "disc_var": zero.clone(),  # τ², scaled units²
            "declined": zero.clone(),  # 0 an interval; else a DECLINE code
            "dof": zero.clone(),  # the fleet's residual degrees of freedom Σ_i ν_i
        }

    def _heldout(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        """A unit's design-matched hold-out (step I2): its uploads to the interval's sums.

        A unit with at least twice the probe's rows keeps, for each probe row, its own
        nearest row (by position in its own span, :func:`_unit_span`; a row of the
        opposite sweep direction only if no other; without directions, its first visit of
        that set point), fits its posterior under the
        broadcast prior from those rows alone, and
        counts, for each τ² of :data:`TAU_GRID`, the other rows whose error lies within
        ±1.96 √(v + τ²) (v the predictive variance the fit states). Every unit with at
        most ``probe_rows`` rows also uploads its inputs' span positions and directions
        (the server's candidate probe: chamber set points, no targets).
        """
        x, y, mask = data.x.to(F64), data.y[..., 0].to(F64), data.mask.to(F64)
        c, rows = mask.shape
        branch = torch.zeros(c, rows, dtype=F64) if data.branch is None else data.branch.to(F64)
        px, pb, pn = down["probe_x"].to(F64), down["probe_b"].to(F64), down["probe_n"].to(F64)
        valid = (torch.arange(px.shape[1]).unsqueeze(0) < pn.unsqueeze(1)).to(F64)
        u = _unit_span(x, mask)  # positions within the unit's own calibrated span
        dist = torch.cdist(px, u) + 1e3 * ((pb.unsqueeze(-1) * branch.unsqueeze(-2)) < 0)
        dist = dist.masked_fill(mask.unsqueeze(1) == 0, math.inf)
        able = ((data.count.to(F64) >= 2 * pn) & (pn > 0)).to(F64).unsqueeze(1)
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
        sub = moments(self.design(x, data.branch), y, keep)
        stats = _masked(sub, down["mask"]) if "mask" in down else sub
        noise = self._noise(down, state)
        post = posterior(stats, down["mu"], down["sigma"], noise)
        coef, cov = post.mean, post.cov
        if "mask" in down:  # as in personalize: terms outside the chosen basis are not in it
            m = down["mask"]
            coef, cov = coef * m, cov * m.unsqueeze(-1) * m.unsqueeze(-2)
        mean, var = self._mean_var(coef, cov, noise, x)
        err2 = (y - mean).square().unsqueeze(-1)
        inside = err2 <= 1.959964**2 * (var.unsqueeze(-1) + TAU_GRID)
        n = data.count.to(F64)
        own = (n <= self.probe_rows).to(F64)
        r = min(rows, self.probe_rows)
        probe_x = torch.zeros(c, self.probe_rows, x.shape[-1], dtype=F64)
        probe_x[:, :r] = u[:, :r] * own.reshape(-1, 1, 1)
        probe_b = torch.zeros(c, self.probe_rows, dtype=F64)
        probe_b[:, :r] = branch[:, :r] * own.unsqueeze(1)
        return {
            "x": probe_x,
            "b": probe_b,
            "n": n * own,
            "inside": (inside.to(F64) * held.unsqueeze(-1)).sum(1),
            "held": held.sum(1),
        }

    def _interval_update(self, server: Tree, replies: Tree, order: Tensor, total: dict) -> Tree:
        """The server's step I3: the probe, τ² from the hold-out sums, and whether to decline."""
        if self.interval != "calibrated":
            return {}
        iv = {k: v[order] for k, v in replies["interval"].items()}
        out = self._interval_init()
        small = iv["n"] > 0
        if bool(small.any()):  # the smallest design (ties: canonical order) is the probe
            j = int(torch.argmin(torch.where(small, iv["n"], math.inf)))
            out.update(probe_x=iv["x"][j], probe_b=iv["b"][j], probe_n=iv["n"][j])
        out["dof"] = total["dof"]
        code = 0
        if float(server["probe_n"]) > 0:  # the units held out against this probe
            held = float(iv["held"].sum())
            if held == 0:
                code = 2
            else:
                share = iv["inside"].sum(0) / held  # held-out coverage at each τ² of the grid
                covered = share >= self.coverage_target
                if bool(covered.any()):
                    g = int(torch.nonzero(covered)[0, 0])
                    out["disc_var"] = TAU_GRID[g].clone()
                    if g > 0:  # linear between the grid's neighbours, to the target share
                        w = (self.coverage_target - share[g - 1]) / (share[g] - share[g - 1])
                        out["disc_var"] = TAU_GRID[g - 1] + w * (TAU_GRID[g] - TAU_GRID[g - 1])
                else:
                    code = 3
        # Directions of the basis in use that too few units' points determine (the
        # identification rule): an interval along them would be the vague start's.
        used = torch.nonzero(server["mask"] if "mask" in server else self.masks[-1])[:, 0]
        support = total["support"][used][:, used]
        if bool((torch.linalg.eigvalsh(0.5 * (support + support.T)) < self.min_informed).any()):
            code = 5
        if float(total["dof"]) < 1.0:
            code = 1
        out["declined"] = torch.tensor(float(code), dtype=F64)
        return out

    def interval_note(self, server: Tree) -> str:
        """One line: why the run states no interval for (some) units; "" when it states them."""
        if self.interval != "calibrated":
            return ""
        code = int(server["declined"])
        if not code:
            return ""
        return DECLINE[code].format(n=int(server["probe_n"]), dof=float(server["dof"]))

    def dp_statistics(self, down: Tree) -> dict[str, Statistic]:
        """Client-level DP: each uploaded statistic's public map and bound (core/privacy).

        Maps come from the broadcast only (Σ = L Lᵀ, μ, σ²) and the vague start s
        (``init_scale``). The GLS terms in the prior's whitened coordinates are
        bounded by construction: Lᵀ gls_gram_i L = A_i⁻¹B_i has eigenvalues in [0, 1)
        and Lᵀ gls_rhs_i = z̄_i = L⁻¹(m_i − μ), bounded by 2√p (twice a prior draw's
        typical norm). The posterior mean and second moment are taken about μ in the
        units of the vague start — not whitened by the current Σ, which under noise
        would feed back round after round — with ‖m_i − μ‖ ≤ 2√p s and
        ‖E[(c_i − μ)(c_i − μ)ᵀ]‖_F ≤ (2√p s)² + p s². Directions the noise hides
        are not learned: there Σ̂ takes the vague start s², and the support counts no
        informed unit, so the server keeps μ and s² there (its weak-direction rule).
        rss_i/σ² ≈ n_i ≤ ``dp_max_rows`` (bound 1.5×, by the broadcast σ²: a fixed
        scale would drown the RSS of good units in noise), and the noisy Σ rss at most
        the vague start's noise variance × Σ n (σ² never vaguer than the start) and at
        least 10⁻⁸ of it (σ ≥ 10⁻⁴ of the start: without this floor, noise draws that
        sent σ² toward 0 made new units' posterior Cholesky fail at ε = 1); with
        Legendre terms of inputs in [−1, 1], ‖Φ_iᵀΦ_i‖_F ≤ n_i p; the support's
        eigenvalues lie in [0, 1).
        """
        if self.interval != "posterior":
            raise ValueError(
                "fedprior: client-level DP covers interval = 'posterior' only (the hold-out "
                "uploads a unit's inputs)"
            )
        if self.select != "none":
            # Every candidate's statistics would need their own noise (20× the sensitivity).
            raise ValueError(
                "fedprior: client-level DP covers a fixed basis only; set select = 'none' "
                "(the fedprior_fixed variant)"
            )
        p = self.num_features
        chol = safe_cholesky(down["sigma"].to(F64))[0]
        mu, rows, s = down["mu"].to(F64), float(self.dp_max_rows), self.init_scale
        z = 2.0 * p**0.5
        second = (z * s) ** 2 + p * s * s
        noise_var = down["noise_var"].to(F64)
        return {
            "mean": Statistic(z * s, "vector", center=mu),
            "second": Statistic(
                second, "second_moment", center=mu, first="mean", noise_floor=True, unresolved=s * s
            ),
            "gls_gram": Statistic(p**0.5, "psd", chol.T, maximum=1.0, noise_floor=True),
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
            "support": Statistic(p**0.5, "psd", maximum=1.0, noise_floor=True, unresolved=0.0),
        }

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        _, post = self._posterior(down, state, self._client_moments(down, data))
        coef, cov = post.mean, post.cov
        if "mask" in down:  # terms outside the chosen basis are not in the model (0, no σ)
            m = down["mask"]
            coef, cov = coef * m, cov * m.unsqueeze(-1) * m.unsqueeze(-2)
        out = {"coef": coef, "cov": cov, "noise_var": self._noise(down, state)}
        if "disc_var" in down:  # τ² for units of the probe's size; declined: no interval
            n, probe = data.count.to(F64), down["probe_n"].to(F64)
            small = n < 2 * probe
            # A unit smaller than any design the fleet held out for (only a unit calibrated
            # later from prior.json can be): its model error was never learned.
            unknown = (n < probe) | ((probe == 0) & (n <= self.probe_rows))
            code = down["declined"]
            out["disc_var"] = torch.where(small, down["disc_var"].to(F64), 0.0)
            fleet_wide = (code == 1) | (code == 5)
            out["declined"] = (fleet_wide | (small & (code > 1)) | unknown).to(F64)
        out["box"] = self._unit_box(down.get("box"), data)
        return out

    # ---- the extrapolation guard (models.basis.linearized_products) ------------------
    def _open_box(self) -> Tensor:
        """(2, inputs): no support known yet (round 0): nothing is extrapolation."""
        inf = torch.full((self.num_inputs,), math.inf, dtype=F64)
        return torch.stack([-inf, inf])

    def _input_box(self, gram: Tensor) -> Tensor:
        """The fleet's input support (2, inputs) from its summed Gram Σ_i Φ_iᵀΦ_i.

        Row/column 0 is the constant term and e_j the term P̃_1(x_j) = √3·x_j, so
        G[0,0] = Σn, G[0,e_j] = √3·Σx_j and G[e_j,e_j] = 3·Σx_j²: each input's fleet mean
        m_j and standard deviation s_j, from the sums the federation already adds (no
        unit's rows, nor its own range, leave it). The box is m_j ± SUPPORT_STDS·s_j; an
        input without a linear term stays open.
        """
        box = self._open_box()
        n = gram[0, 0]
        if not float(n) > 0:
            return box
        for j in range(self.num_inputs):
            e_j = tuple(int(k == j) for k in range(self.num_inputs))
            if e_j not in self.terms:
                continue
            k = self.terms.index(e_j)
            mean = gram[0, k] / (math.sqrt(3.0) * n)
            std = (gram[k, k] / (3.0 * n) - mean * mean).clamp_min(0.0).sqrt()
            box[0, j], box[1, j] = mean - SUPPORT_STDS * std, mean + SUPPORT_STDS * std
        return box

    def _unit_box(self, fleet_box: Tensor | None, data: ClientData) -> Tensor:
        """(clients, 2, inputs): the fleet's box widened to each unit's own training range.

        Without a fleet box (a model saved before the guard): the unit's own range.
        ``fedcal calibrate`` and the planner broadcast the prior's calibrated input range
        (:func:`fedcal.calibration.prior_server`), not the federation's mean ± sd box.
        """
        real = data.mask.unsqueeze(-1) > 0
        x = data.x.to(F64)
        lo = torch.where(real, x, math.inf).amin(1)
        hi = torch.where(real, x, -math.inf).amax(1)
        if fleet_box is None:
            return torch.stack([lo, hi], 1)
        fleet_box = fleet_box.to(F64).expand(x.shape[0], 2, x.shape[-1])
        return torch.stack(
            [torch.minimum(lo, fleet_box[:, 0]), torch.maximum(hi, fleet_box[:, 1])], 1
        )

    def _guarded(self, params: Tree, x: Tensor, terms) -> tuple[Tensor, Tensor]:
        """(ψ(x), beyond) of ``terms``: the basis linearized beyond the unit's box, per row."""
        if "box" not in params:
            phi = legendre_products(x, terms)
            return phi, torch.zeros(phi.shape[:-1], dtype=torch.bool)
        box = params["box"].to(F64)
        return linearized_products(x, terms, box[:, 0].unsqueeze(1), box[:, 1].unsqueeze(1))

    def beyond_support(self, params: Tree, x: Tensor) -> Tensor:
        """(clients, rows) bool: rows outside the unit's support box (linearized, flagged)."""
        return self._guarded(params, x, self.terms)[1]

    def predict(self, params: Tree, x: Tensor) -> Tensor:
        """ψ(x)ᵀm_c (ψ = φ inside the support box, its tangent-plane continuation beyond):
        with a direction term, the branch average (the field's b is unknown)."""
        p = len(self.terms)
        phi, _ = self._guarded(params, x, self.terms)
        value = (phi * params["coef"][..., :p].to(F64).unsqueeze(1)).sum(-1)
        return value.unsqueeze(-1).to(x.dtype)

    def predictive_std(self, params: Tree, x: Tensor) -> Tensor:
        """√(z(x)ᵀQ z(x) + s [+ g(x)²]) per row (clients, rows, 1), scaled.

        z, Q, s: :meth:`variance_form`. Beyond the unit's support box the prediction is
        the basis's tangent-plane continuation (:meth:`predict`); the gap g(x) between
        the polynomial and that continuation is added as model-form variance there.
        """
        q, s = self.variance_form(params)
        var = predictive_var(self.variance_design(x), q, s)
        phi, beyond = self._guarded(params, x, self.terms)
        if any_beyond(beyond):  # beyond the support: + (polynomial − linearized)² (model form)
            coef = params["coef"][..., : len(self.terms)].to(F64).unsqueeze(1)
            gap = ((legendre_products(x, self.terms) - phi) * coef).sum(-1)
            var = var + torch.where(beyond, gap * gap, 0.0)
        return var.sqrt().unsqueeze(-1).to(x.dtype)

    def variance_design(self, x: Tensor) -> Tensor:
        """z(x) = [φ(x), ψ(x)] (clients, rows, features), float64: no sign b (unknown in use)."""
        phi = legendre_products(x, self.terms)
        if not self.branch_orders:
            return phi
        return torch.cat([phi, legendre_products(x, self.branch_terms)], -1)

    def variance_form(self, params: Tree) -> tuple[Tensor, Tensor]:
        """(Q, s): the predictive variance as z(x)ᵀQ z(x) + s, z = :meth:`variance_design`.

        Q = blockdiag(V_cc, m_h m_hᵀ + V_hh) — the posterior covariance of c and,
        with a direction term, E[h hᵀ] (b unknown: E[b] = 0, E[b²] = 1; module
        doc) — and s = Σ of the unit's additive variances: every per-unit scalar
        parameter named ``*_var`` (σ_i² = ``noise_var``; a further additive term
        stored the same way is included). The single place of the predictive
        variance: :meth:`predictive_std` and the firmware/JSON exports read it.
        """
        p = len(self.terms)
        cov = params["cov"].to(F64)
        q = torch.zeros_like(cov)
        q[..., :p, :p] = cov[..., :p, :p]
        if self.branch_orders:
            m_h = params["coef"][..., p:].to(F64)
            q[..., p:, p:] = m_h.unsqueeze(-1) * m_h.unsqueeze(-2) + cov[..., p:, p:]
        batch = cov.shape[:-2]
        s = torch.zeros(batch, dtype=F64)
        for key, value in params.items():
            if key.endswith("_var") and tuple(value.shape) == tuple(batch):
                s = s + value.to(F64)  # σ_i², and τ_i² (disc_var) with a calibrated interval
        if "declined" in params:  # no interval stated for this unit (module doc, "Intervals")
            s = torch.where(params["declined"].to(F64) > 0, math.nan, s)
        return q, s

    def _mean_var(self, coef: Tensor, cov: Tensor, noise: Tensor, x: Tensor):
        """φᵀm_c and the predictive variance of :meth:`variance_form` per row (clients, rows)
        for a posterior (coef, cov) and noise σ_i²: the hold-out's predictions (I2)."""
        coef, p = coef.to(F64), len(self.terms)
        mean = (legendre_products(x, self.terms) * coef[..., :p].unsqueeze(1)).sum(-1)
        noise = noise.to(F64).expand(cov.shape[:-2])  # one σ² per unit (a fleet's: broadcast)
        q, s = self.variance_form({"coef": coef, "cov": cov, "noise_var": noise})
        return mean, predictive_var(self.variance_design(x), q, s)

    # ---- what a user keeps -----------------------------------------------------
    def identification(self, server: Tree) -> dict[str, Any]:
        """How many units' data informed each direction of the basis, and which are weak.

        ``support`` is Σ_i of each unit's :func:`~fedcal.core.bayes.data_support`
        (last round): its eigenvalues are effective counts of units whose own
        points determine a direction. A direction informed by fewer than
        ``min_informed`` units is weakly identified: the prior there is not
        learned but the vague ``init_scale``; it is named by the basis terms that
        load on it (at least half the largest loading). With ``select = "bic"``:
        the chosen basis's terms only.
        """
        names, idx = self.chosen_features(server)
        support = server["support"][idx][:, idx]
        if not torch.any(support != 0):
            return {"informed_units": [], "weak_terms": [], "weak_directions": 0}
        vals, vecs = torch.linalg.eigh(0.5 * (support + support.T))
        weak, directions = [], 0
        for k in range(len(vals)):
            if vals[k] < self.min_informed:
                directions += 1
                loading = vecs[:, k].abs()
                big = torch.nonzero(loading >= 0.5 * loading.max())[:, 0].tolist()
                weak += [names[j] for j in big]
        return {
            "informed_units": [round(float(v), 3) for v in vals],
            "weak_terms": sorted(set(weak)),
            "weak_directions": directions,
        }

    def client_status(self, server: Tree, personal: Tree, x: Tensor, mask: Tensor) -> dict:
        """A unit is "weak" when its predictions at ``x`` lean on weakly identified directions.

        With W the orthonormal weak directions of the chosen basis (eigenvectors of the
        summed ``support`` below ``min_informed``, as :meth:`identification`), the share
        of the unit's predictive variance that comes from its coefficients along W,

            s_i = Σ_rows (φᵀW)(WᵀV_iW)(Wᵀφ) / Σ_rows (φᵀV_iφ + σ_i²),

        is the part of its prediction's uncertainty that the fleet's data did not learn
        (the vague ``init_scale`` prior). The unit is weak when s_i > ``WEAK_SHARE``
        (one half): its number is mostly the starting prior's, not a calibration. A
        unit whose own points determine W has a small V_i along W and is not weak.
        """
        n = x.shape[0]
        _, idx = self.chosen_features(server)
        support = server["support"][idx][:, idx]
        none = torch.zeros(n, dtype=torch.bool)
        if not torch.any(support != 0):
            return {"weak": none}
        vals, vecs = torch.linalg.eigh(0.5 * (support + support.T))
        weak_in_chosen = vecs[:, vals < self.min_informed]
        if not weak_in_chosen.shape[1]:
            return {"weak": none}
        p = len(self.terms)
        full = torch.zeros(server["support"].shape[0], weak_in_chosen.shape[1], dtype=F64)
        full[idx] = weak_in_chosen
        w = full[:p]  # φ's coordinates (a direction term's share is not in predict)
        phi = legendre_products(x.to(F64), self.terms)  # (clients, rows, p)
        cov = personal["cov"].to(F64)[..., :p, :p]
        a = phi @ w  # (clients, rows, k)
        weak_var = ((a @ (w.T @ cov @ w)) * a).sum(-1)
        total = predictive_var(phi, cov, personal["noise_var"].reshape(n))
        m = mask.to(F64)
        share = (weak_var * m).sum(1) / (total * m).sum(1).clamp_min(1e-300)
        return {"weak": share > WEAK_SHARE}

    def chosen_features(self, server: Tree) -> tuple[list[str], Tensor]:
        """Names and indices (in the design) of the features in use: φ's chosen terms, then ψ's.

        Read from the server's ``mask`` (the chosen candidate's, :attr:`masks`); a
        sub-basis keeps the full basis's term order, so its own order is ascending index.
        """
        mask = server["mask"] if self.select != "none" else self.masks[-1]
        idx = torch.nonzero(mask)[:, 0]
        p = len(self.terms)
        names = [
            term_name(self.terms[j]) if j < p else f"b·{term_name(self.branch_terms[j - p])}"
            for j in idx.tolist()
        ]
        return names, idx

    def chosen(self, server: Tree) -> tuple[tuple[tuple[int, ...], ...], Tensor]:
        """The basis in use: its terms (own order) and their indices in :attr:`terms`."""
        _, idx = self.chosen_features(server)
        idx = idx[idx < len(self.terms)]
        return tuple(self.terms[j] for j in idx.tolist()), idx

    def chosen_branch(self, server: Tree) -> tuple[tuple[int, ...], ...]:
        """ψ's terms in use (all of :attr:`branch_terms` unless ψ is selected)."""
        _, idx = self.chosen_features(server)
        p = len(self.terms)
        return tuple(self.branch_terms[j - p] for j in idx.tolist() if j >= p)

    def export_state(self, server: Tree) -> dict[str, Any]:
        """The fleet prior as JSON-able data: what ``fedcal calibrate`` needs.

        With ``select = "bic"`` it is the chosen basis's prior (its own terms), and
        ``selection`` records the choice (parameters that rebuild that basis) and
        every candidate's score.
        """
        terms, _ = self.chosen(server)
        _, idx = self.chosen_features(server)  # μ and Σ over (c, h) jointly
        state = {
            "kind": "fedprior",
            "terms": [list(t) for t in terms],
            "term_names": [term_name(t) for t in terms],
            "mu": server["mu"][idx].tolist(),
            "sigma": server["sigma"][idx][:, idx].tolist(),
            "noise_var": float(server["noise_var"]),
            "noise": self.noise,
            "noise_prior_points": self.noise_prior_points,
            "identification": self.identification(server),
        }
        if self.interval == "calibrated":
            state["interval"] = {
                "rule": "calibrated",
                "discrepancy_var": float(server["disc_var"]),
                "probe_rows": float(server["probe_n"]),
                "residual_dof": float(server["dof"]),
                "declined": int(server["declined"]),
                "reason": self.interval_note(server),
            }
        psi = self.chosen_branch(server)
        if psi:
            state["branch_terms"] = [list(t) for t in psi]
            state["branch_term_names"] = [f"b·{term_name(t)}" for t in psi]
        if self.select != "none":
            state["selection"] = {
                "rule": self.select,
                "chosen": self.candidates[int(server["choice"])],
                "candidates": list(self.candidates),
                "scores": [round(float(v), 3) for v in server["scores"]],
            }
        return state


# τ² candidates of the hold-out (scaled units²: the target is scaled to O(1)): 0, then 10 per
# decade from 1e-12 to 1e2 (steps of 12 % in σ).
TAU_GRID = torch.cat([torch.zeros(1, dtype=F64), torch.logspace(-12, 2, 141, dtype=F64)])
# What the broadcast carries for the interval (the server also keeps "dof").
INTERVAL_KEYS = ("probe_x", "probe_b", "probe_n", "disc_var", "declined")
DECLINE = {
    1: "no interval: no unit has residual degrees of freedom (Σ ν = {dof:.2g}): every unit's "
    "basis fits its points exactly, so the noise level cannot be estimated",
    2: "no interval: no unit has at least twice the points of the smallest design ({n} "
    "points), so the model error between its points cannot be learned from this fleet",
    3: "no interval: even the largest discrepancy variance did not cover 95 % of the "
    "held-out points of the units with more points than the smallest design ({n} points)",
    4: "no interval for units with fewer points than the fleet's smallest design ({n} points; "
    "none: no unit had at most probe_rows): their model error was not learned",
    5: "no interval: the fleet's points do not identify every direction of the basis in use "
    "(see the weak terms): an interval along them would be the vague start's, not learned",
}


def _unit_span(x: Tensor, mask: Tensor) -> Tensor:
    """Each row's inputs as positions in [0, 1] of its unit's own span (min to max per input).

    A chamber design is a pattern over a unit's calibrated range (its ends included); units
    of one fleet read different input values there (each resonator its own frequencies), so
    the hold-out matches designs by these positions, not by raw inputs.
    """
    m = mask.unsqueeze(-1) > 0
    lo = torch.where(m, x, math.inf).amin(1, keepdim=True)
    hi = torch.where(m, x, -math.inf).amax(1, keepdim=True)
    return torch.where(m, (x - lo) / (hi - lo).clamp_min(1e-12), 0.0)


def _residual_terms(post: Posterior, gram: Tensor, noise: Tensor, n: Tensor) -> Tree:
    """Residual degrees of freedom n_i − tr(G_i V_i)/σ_i² and the fit ‖y_i − Φ_i m_i‖²
    (= E‖y_i − Φ_i c_i‖² − tr(G_i V_i)): the restricted noise update's terms (module doc,
    "Intervals")."""
    spent = (gram * post.cov).sum((-2, -1))
    return {"dof": (n - spent / noise).clamp_min(0.0), "fit": (post.rss - spent).clamp_min(0.0)}


def _masked(stats: Moments, mask: Tensor) -> Moments:
    """The moments of the sub-basis ``mask`` (…, p): other rows/columns of G and b zeroed."""
    m = mask.to(F64)
    return Moments(stats.gram * m.unsqueeze(-1) * m.unsqueeze(-2), stats.rhs * m, stats.yy, stats.n)


def term_name(exponents: tuple[int, ...]) -> str:
    """A readable name of a basis term: (2, 1) → 'P2(x0)·P1(x1)', (0, 0) → '1'."""
    parts = [f"P{a}(x{j})" for j, a in enumerate(exponents) if a]
    return "·".join(parts) or "1"
