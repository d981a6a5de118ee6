"""Per-sensor polynomial calibration: the least-squares surface a careful engineer fits.

Not federated: every sensor is fitted alone on its own calibration points, the
way resonant barometers are characterised today (the Digiquartz calibration
equations, or a polynomial surface fitted to a chamber sweep). With every named
input x_1..x_F (a barometer: frequency f and temperature T) the surface is a
tensor polynomial of orders o = (o_1, …, o_F), one order per input:

    y = Σ_{α_k ≤ o_k} a_α · Π_k L̃_{α_k}(u_k),    u_k = 2·(x_k − lo_k)/(hi_k − lo_k) − 1,

with L̃_n = √(2n+1)·P_n the normalized Legendre polynomials and [lo_k, hi_k] the
range of input k over this sensor's calibration points. An affine map of an
input maps the span of its monomials onto itself, so this is exactly the
classic Σ a_ij f^i T^j surface; Legendre terms on [-1, 1] only keep the QR
well-conditioned (the raw monomial design squares nothing but still loses
digits at order 4).

Steps per client (closed form, batched over the cohort, float64 inside):

1. **Levels and supported orders.** Input k has L_k levels: scanning its
   sorted values, a new level starts more than ``level_gap``·(hi_k − lo_k)
   above the start of the current one (a chamber plateau read with noise is
   one temperature; a pressure level read at several temperatures is one
   frequency). An order o is *supported* when 1 ≤ o_k ≤ min(L_k − 1,
   max_orders[k]) for every input — every named input is used, none is
   dropped — its k = Π(o_k + 1) coefficients are at most n (the sensor's
   points) and its design has full rank (QR diagonal above ``rcond`` × its
   largest entry). Every supported order is a candidate, not only those that
   fit a cross-validation fold: a 3 × 2 grid supports o ≤ (2, 1), a 4 × 3
   grid o ≤ (3, 2).
2. **Choice among the orders with residual degrees of freedom** (k < n), by
   ``criterion``:
   ``"loo"``: exact leave-one-out, the PRESS statistic (Allen 1974): the
   residual of row i when the model is refitted without it is e_i/(1 − h_ii),
   h_ii the diagonal of the hat matrix X(XᵀX)⁻¹Xᵀ = squared row norms of Q from
   the QR of X; score √(Σ (e_i/(1 − h_ii))²/n). A row with h_ii = 1 cannot be
   predicted without itself: that order is not cross-validatable (score ∞);
   ``"gcv"``: generalized cross-validation (Golub, Heath & Wahba 1979),
   √(n·RSS)/(n − k);
   ``"aicc"``: corrected AIC (Hurvich & Tsai 1989), n·log(RSS/n) + 2k +
   2k(k+1)/(n−k−1), scored as exp(AICc/2n) so that it reads like an RMSE.
   The choice is the *smallest* order whose score is within ``tolerance``
   (relative) plus ``floor`` (absolute, scaled target units) of the best — so
   that an exact surface is not traded for a bigger one that is also exact.
3. **Saturated fits** (k = n, zero residual dof) interpolate: no criterion can
   judge them against the others, so a rule decides (``saturate``):
   ``"grid"``: the full interpolant of a complete tensor grid — o_k = L_k − 1
   for every input, Π L_k = n, full rank — is preferred to every
   cross-validated order (tensor interpolation on a grid is unisolvent; it is
   the design a calibration engineer lays out for that surface: 3 × 2 points
   for (2, 1), 4 × 3 for (3, 2));
   ``"last_resort"``: when no order beyond the smallest (all orders 1) can be
   cross-validated, a supported saturated order is preferred — the one with
   the smallest Lebesgue constant max_u Σ_i |ℓ_i(u)| on the unit box (ℓ_i the
   weight of point i in the fitted value at u: the least amplification of the
   errors at the points);
   ``"auto"`` (default): both rules; ``"never"``: neither.
   A chosen saturated fit is flagged (``saturated`` = 1, ``dof`` = 0).
4. The coefficients are the least-squares solution of the chosen order (QR of
   its design, no normal equations).
5. A client that has been fitted keeps its fit in later rounds (the method is
   idempotent — one round suffices).

``orders=(o_1, …, o_F)`` fixes the orders instead of steps 1–3 (refused where
the design does not support them, flagged if saturated).

**Refused sensors.** A sensor whose points do not support the smallest model
that uses every input (orders 1: 2^F coefficients, two levels of every input)
is refused: its coefficients and predictions are NaN, so its errors and the
fleet's read ``nan``, never a number. Per sensor and round the client metrics
(``metrics.csv``) say what was fitted: ``order_0 … order_{F−1}`` (per input, in
the fleet's feature order), ``coefficients``, ``dof`` (n − k; NaN if refused),
``saturated`` and ``refused`` (0/1).

Defaults (ours, measured off the grid by ``studies/polynomial_fewpoint.py``,
docs/results/polynomial-off-grid.md): orders up to 4 per input (the Digiquartz equation is close to
a quartic in frequency; calibration sheets carry cubic temperature terms);
``criterion="loo"`` (GCV was within ±7 % of it on the mean, worse on the worst
sensor at 24 spread points; AICc was worse at 12 harsh points);
``saturate="auto"`` (3 × 2 grid: 3.3 hPa against 10.6 never saturating, 4 × 3:
0.099 against 0.102); ``tolerance=0``; ``level_gap`` 5 % of an input's span —
enough to resolve the ≤ 5 levels a quartic needs, and wider than the ≈1–3 %
by which the simulator's frequency moves with temperature at one pressure.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Annotated, Literal, NamedTuple

import torch
from pydantic import Field
from torch import Tensor

from fedcal.core.algorithm import Algorithm, ClientResult, SettingError
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.core.tree import Tree, leaves
from fedcal.models.basis import (
    MAX_TERMS,
    any_beyond,
    basis_size,
    legendre,
    linearized_products,
    orders_by_size,
)
from fedcal.status import Status

F64 = torch.float64
# Beyond a sensor's calibrated range by more than this fraction of the span (per side),
# the surface is linearized (predict): the 5 % of `fedcal calibrate`'s range check.
RANGE_MARGIN = 0.05


def input_range(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per client and input, min and max over the real rows: (clients, F) each (0 if no rows)."""
    real = mask.unsqueeze(-1) > 0
    lo = torch.where(real, x, torch.inf).amin(1)
    hi = torch.where(real, x, -torch.inf).amax(1)
    has_rows = real.any(1)
    return torch.where(has_rows, lo, 0.0), torch.where(has_rows, hi, 0.0)


def to_unit_interval(x: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """u = 2(x − lo)/(hi − lo) − 1: x (clients, rows, F), lo, hi (clients, F)."""
    span = torch.where(hi > lo, hi - lo, 1.0)
    return 2.0 * (x - lo.unsqueeze(1)) / span.unsqueeze(1) - 1.0


def count_levels(x: Tensor, mask: Tensor, gap: float) -> Tensor:
    """Distinct levels of every input per client (clients, F) (step 1).

    Scanning the sorted values, a level starts at the first value more than
    ``gap`` × the input's span above the start of the current level: a
    chamber plateau read with noise is one level, dense scattered values
    count about 1/gap levels.
    """
    real = mask.unsqueeze(-1) > 0  # (clients, rows, 1)
    lo, hi = input_range(x, mask)
    width = gap * (hi - lo)  # (clients, F)
    ordered = torch.where(real, x, torch.inf).sort(1).values  # real rows first
    count = (mask.sum(1) > 0).to(F64).unsqueeze(1).expand_as(lo)
    start = ordered[:, 0]
    for i in range(1, ordered.shape[1]):
        new_level = (ordered[:, i] - start > width) & real[:, i]  # inf − inf is NaN: False
        count = count + new_level.to(F64)
        start = torch.where(new_level, ordered[:, i], start)
    return count


def tensor_design(u: Tensor, exponents: Tensor) -> Tensor:
    """Π_k L̃_{α_k}(u_k) per α of ``exponents`` (terms, F): (..., rows, F) → (..., rows, terms)."""
    top = exponents.amax(0).tolist()
    per_input = [torch.stack(legendre(u[..., k], top[k]), -1) for k in range(u.shape[-1])]
    design = torch.ones(*u.shape[:-1], len(exponents), dtype=u.dtype)
    for k, values in enumerate(per_input):
        design = design * values[..., exponents[:, k]]
    return design


class LeastSquares(NamedTuple):
    """A least-squares fit per client by QR (no normal equations)."""

    coef: Tensor  # (clients, k)
    resid: Tensor  # (clients, rows) y − X·coef, 0 on padding
    leverage: Tensor  # (clients, rows) h_ii = diag of X(XᵀX)⁻¹Xᵀ = squared row norms of Q
    full_rank: Tensor  # (clients,) bool: |R_jj| > rcond · max |R_jj|
    q: Tensor  # (clients, rows, k)
    r: Tensor  # (clients, k, k), unit diagonal where R is singular (keeps solves finite)


def least_squares(design: Tensor, y: Tensor, mask: Tensor, rcond: float) -> LeastSquares:
    """min ‖X·a − y‖ over the real rows; design (clients, rows ≥ k, k) zero on padding."""
    q, r = torch.linalg.qr(design)  # reduced: q (clients, rows, k), r (clients, k, k)
    diag = r.diagonal(dim1=-2, dim2=-1).abs()
    full_rank = diag.amin(-1) > rcond * diag.amax(-1).clamp_min(1e-300)
    # Singular fits are never used; a unit pivot only keeps their numbers finite.
    r = r + torch.diag_embed((diag <= 0).to(r.dtype))
    coef = torch.linalg.solve_triangular(r, q.transpose(1, 2) @ y.unsqueeze(-1), upper=True)
    resid = (y - (design @ coef)[..., 0]) * mask
    return LeastSquares(coef[..., 0], resid, (q * q).sum(-1), full_rank, q, r)


def lebesgue_constant(fit: LeastSquares, probe: Tensor) -> Tensor:
    """max_u Σ_i |ℓ_i(u)| over the ``probe`` points (points, k) of the basis: (clients,).

    ℓ_i(u) = row u of D·R⁻¹·Qᵀ, the weight of calibration point i in the fitted
    value at u: how much the fit can amplify errors at the points (step 3).
    """
    clients = fit.r.shape[0]
    cardinal = torch.linalg.solve_triangular(
        fit.r, probe.expand(clients, -1, -1), upper=True, left=False
    ) @ fit.q.transpose(1, 2)
    return cardinal.abs().sum(-1).amax(-1)


@dataclass(frozen=True)
class PolynomialCalibration(Algorithm):
    @property
    def uses_local_epochs(self) -> bool:  # closed form
        return False

    # per input, or one value for every input (every input is used: at least 1)
    max_orders: Annotated[tuple[Annotated[int, Field(ge=1)], ...], Field(min_length=1)] = (4,)
    # fixed orders instead of steps 1–3 (each in 1…max_orders: check_task)
    orders: tuple[Annotated[int, Field(ge=1)], ...] | None = None
    criterion: Literal["loo", "gcv", "aicc"] = "loo"
    saturate: Literal["auto", "grid", "last_resort", "never"] = "auto"
    tolerance: Annotated[float, Field(ge=0.0)] = 0.0
    floor: Annotated[float, Field(ge=0.0)] = 1e-9
    level_gap: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.05
    rcond: Annotated[float, Field(ge=0.0)] = 1e-10

    name = "polynomial"
    uploads = ()
    federated = False
    one_shot = True  # step 5: a fitted sensor keeps its fit; one round suffices

    def __post_init__(self) -> None:
        # A TOML config gives lists; orders are compared as tuples.
        object.__setattr__(self, "max_orders", tuple(int(o) for o in self.max_orders))
        if self.orders is not None:
            object.__setattr__(self, "orders", tuple(int(o) for o in self.orders))

    def check_task(self, task: Task) -> None:
        if len(self.max_orders) not in (1, self.num_inputs):
            raise SettingError(
                "max_orders",
                f"{len(self.max_orders)} entries but the data has {self.num_inputs} inputs: "
                "give one order per input, or one for all",
            )
        if basis_size(self.num_inputs, [1] * self.num_inputs) > MAX_TERMS:
            raise ValueError(
                f"polynomial: {self.num_inputs} inputs need at least 2^{self.num_inputs} "
                f"coefficients (order 1 in every input), more than the {MAX_TERMS} allowed; "
                "use fewer features or a total-degree method (fedprior, leastsq)"
            )
        if self.orders is not None:
            if len(self.orders) != self.num_inputs:
                raise SettingError(
                    "orders", f"{self.orders} must give one order per input ({self.num_inputs})"
                )
            if any(o > m for o, m in zip(self.orders, self.top_orders, strict=True)):
                raise SettingError(
                    "orders", f"{self.orders} must lie in 1…max_orders {self.top_orders}"
                )

    # ---- the basis and the candidate orders ------------------------------
    @property
    def num_inputs(self) -> int:
        """F, the width of the model's input (every named feature)."""
        width = getattr(self.task.model, "in_features", None)
        if width is None:
            raise ValueError(
                "polynomial needs the input width (the task's model has no in_features)"
            )
        return int(width)

    @property
    def asked_orders(self) -> tuple[int, ...]:
        """``max_orders`` with one entry per input (as configured)."""
        return self.max_orders * self.num_inputs if len(self.max_orders) == 1 else self.max_orders

    @property
    def top_orders(self) -> tuple[int, ...]:
        """The highest orders used: ``max_orders``, reduced until the basis fits MAX_TERMS.

        The tensor basis has Π(o_k + 1) terms: order 4 over 8 inputs is 390,625 (a
        19.5 TB design for a real network). The largest order is lowered first (ties: the
        last input, so the first-named input keeps the most) until the basis holds at most
        :data:`~fedcal.models.basis.MAX_TERMS` terms; :attr:`note` says so in one line.
        Orders 1 everywhere (2^F terms) beyond it
        are refused at construction.
        """
        top = list(self.asked_orders)
        while basis_size(len(top), top) > MAX_TERMS and max(top) > 1:
            k = max(range(len(top)), key=lambda j: (top[j], j))
            top[k] -= 1
        return tuple(top)

    @property
    def note(self) -> str:
        """One line when the orders were reduced to fit the basis-size limit (else empty)."""
        if self.top_orders == self.asked_orders:
            return ""
        return (
            f"max_orders {list(self.asked_orders)} over {self.num_inputs} inputs is a basis of "
            f"{basis_size(self.num_inputs, self.asked_orders):,} terms; reduced to orders "
            f"{list(self.top_orders)} ({basis_size(self.num_inputs, self.top_orders)} terms, "
            f"limit {MAX_TERMS})"
        )

    @property
    def exponents(self) -> Tensor:
        """(terms, F): every α with α_k ≤ top_orders[k], the basis of the coefficient vector."""
        return torch.tensor(list(itertools.product(*(range(m + 1) for m in self.top_orders))))

    @property
    def candidates(self) -> list[tuple[int, ...]]:
        """Orders to choose from, fewest coefficients first (ties: lexicographic)."""
        if self.orders is not None:
            return [self.orders]
        return orders_by_size(self.top_orders, lowest=1)

    def term_mask(self, orders: tuple[int, ...]) -> Tensor:
        """(terms,) bool: which basis terms a surface of ``orders`` uses."""
        return (self.exponents <= torch.tensor(orders)).all(1)

    # ---- steps 1–4 ---------------------------------------------------------
    def fit(self, data: ClientData) -> dict[str, Tensor]:
        """Orders, coefficients and flags per client: steps 1–4 of the module docstring."""
        # Zero rows up to the basis size, so every candidate's R is square.
        pad = max(len(self.exponents) - data.x.shape[1], 0)
        mask = torch.nn.functional.pad(data.mask.to(F64), (0, pad))  # (clients, rows)
        x = torch.nn.functional.pad(data.x.to(F64), (0, 0, 0, pad))
        y = torch.nn.functional.pad(data.y[..., 0].to(F64), (0, pad)) * mask
        n = mask.sum(1)  # (clients,)
        lo, hi = input_range(x, mask)
        levels = count_levels(x, mask, self.level_gap)  # (clients, F)
        full = tensor_design(to_unit_interval(x, lo, hi), self.exponents) * mask.unsqueeze(-1)
        exponents = self.exponents
        clients, terms = data.num_clients, len(exponents)

        fixed = self.orders is not None
        probe = self.probe_design()  # (points, terms): where step 3 measures amplification
        cv, fits = [], []
        for orders in self.candidates:
            used = self.term_mask(orders)
            k = int(used.sum())
            design = full[..., used]  # (clients, rows, k)
            ls = least_squares(design, y, mask, self.rcond)
            order_t = torch.tensor(orders, dtype=F64)
            supported = (order_t <= levels - 1).all(1) & (n >= k) & ls.full_rank
            saturated = n == k
            score = self.score(ls.resid, ls.leverage, mask, n, k)
            cv.append(torch.where(supported & ~torch.isnan(score), score, torch.inf))
            lebesgue = lebesgue_constant(ls, probe[:, used])
            embed = torch.zeros(k, terms, dtype=F64)
            embed[torch.arange(k), used.nonzero()[:, 0]] = 1.0
            fits.append(
                (ls.coef @ embed, order_t, k, saturated, supported, lebesgue, order_t == levels - 1)
            )

        # Step 3's rules, then the best score per client.
        smallest = min(k for _, _, k, *_ in fits)
        richer_cv = torch.zeros(clients, dtype=torch.bool)  # an order beyond the smallest is CV'd
        for score, (_, _, k, *_) in zip(cv, fits, strict=True):
            richer_cv = richer_cv | (torch.isfinite(score) & (k > smallest))
        scores = []
        for score, (_, _, _, saturated, supported, lebesgue, at_levels) in zip(
            cv, fits, strict=True
        ):
            if fixed:
                scores.append(torch.where(supported, 0.0, torch.inf))
                continue
            if self.saturate in ("auto", "last_resort"):  # least amplification first
                admissible = saturated & supported & ~richer_cv
                score = torch.where(admissible, -1.0 / lebesgue.clamp_min(1.0), score)
            if self.saturate in ("auto", "grid"):  # a complete grid's interpolant beats all
                grid = saturated & supported & at_levels.all(1)
                score = torch.where(grid, -1.0, score)
            scores.append(score)
        best_score = torch.stack(scores).amin(0)

        # Step 2's parsimony: the first (smallest) order within tolerance of the best.
        margin = best_score.abs() * self.tolerance + self.floor
        chosen = torch.zeros(clients, dtype=torch.bool)
        out = {
            "coef": torch.full((clients, terms), torch.nan, dtype=F64),
            "orders": torch.zeros(clients, len(self.top_orders), dtype=F64),
            "coefficients": torch.zeros(clients, dtype=F64),
            "dof": torch.full((clients,), torch.nan, dtype=F64),
            "saturated": torch.zeros(clients, dtype=F64),
            "lo": lo,
            "hi": hi,
        }
        for score, (coef, order_t, k, saturated, *_) in zip(scores, fits, strict=True):
            take = (score <= best_score + margin) & torch.isfinite(score) & ~chosen
            chosen = chosen | take
            col = take.unsqueeze(1)
            out["coef"] = torch.where(col, coef, out["coef"])
            out["orders"] = torch.where(col, order_t.expand(clients, -1), out["orders"])
            out["coefficients"] = torch.where(take, float(k), out["coefficients"])
            out["dof"] = torch.where(take, n - k, out["dof"])
            out["saturated"] = torch.where(take, saturated.to(F64), out["saturated"])
        out["refused"] = (~chosen).to(F64)
        return out

    def probe_design(self) -> Tensor:
        """The basis on a tensor grid of the unit box (points, terms): 2·max order + 1 points
        per input (≤ 729 in all) — a cost of points × rows per candidate, kept small."""
        f = len(self.top_orders)
        per_input = min(2 * max(self.top_orders) + 1, max(3, int(729 ** (1 / f) + 1e-9)))
        side = torch.linspace(-1.0, 1.0, per_input, dtype=F64)
        points = torch.cartesian_prod(*([side] * f)).reshape(-1, f)
        return tensor_design(points, self.exponents)

    def score(self, resid: Tensor, leverage: Tensor, mask: Tensor, n: Tensor, k: int) -> Tensor:
        """Step 2's criterion per client (clients,), RMSE-like (scaled target units)."""
        rss = resid.pow(2).sum(1)
        dof = n - k
        if self.criterion == "loo":
            free = (1.0 - leverage) * mask
            # h_ii = 1: the row determines a coefficient alone, so it cannot be left out.
            predictable = ((free > 1e-9) | (mask == 0)).all(1)
            loo = torch.where(mask > 0, resid / torch.where(free > 1e-9, free, 1.0), 0.0)
            press = loo.pow(2).sum(1)
            return torch.where(predictable & (dof > 0), (press / n.clamp_min(1)).sqrt(), torch.inf)
        if self.criterion == "gcv":
            return torch.where(dof > 0, (n * rss).sqrt() / dof.clamp_min(1), torch.inf)
        # aicc: exp(AICc / 2n) = √(RSS/n)·exp((k + k(k+1)/(n−k−1))/n)
        ok = dof > 1
        n_safe = n.clamp_min(1)
        penalty = (k + k * (k + 1) / torch.where(ok, dof - 1, 1.0)) / n_safe
        return torch.where(ok, (rss / n_safe).sqrt() * penalty.exp(), torch.inf)

    # ---- the contract ----------------------------------------------------
    def client_init(self, down: Tree) -> Tree:
        n, f = leaves(down)[0].shape[0], len(self.top_orders)
        zeros = torch.zeros(n, dtype=F64)
        return {
            "coef": torch.zeros(n, len(self.exponents), dtype=F64),
            "orders": torch.zeros(n, f, dtype=F64),
            "lo": torch.zeros(n, f, dtype=F64),
            "hi": torch.zeros(n, f, dtype=F64),
            "coefficients": zeros,
            "dof": zeros,
            "saturated": zeros,
            "refused": zeros,
            "fitted": zeros,
        }

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        if data.x.shape[-1] != len(self.top_orders):
            raise ValueError(
                f"polynomial: the data has {data.x.shape[-1]} inputs, the model {self.num_inputs}"
            )
        new = self.fit(data)
        # Step 5: a fitted sensor keeps its calibration (idempotent over rounds).
        done = state["fitted"] > 0.5
        new_state = {}
        for key, old in state.items():
            if key == "fitted":
                continue
            keep = done.view(-1, *([1] * (old.dim() - 1)))
            new_state[key] = torch.where(keep, old, new[key])
        new_state["fitted"] = torch.ones_like(state["fitted"])
        params = self.personalize(down, new_state, data)
        pred = self.predict(params, data.x)
        mse = ((pred - data.y).pow(2).mean(-1) * data.mask).sum(1) / data.mask.sum(1).clamp_min(1)
        dtype = data.x.dtype
        metrics = {"train_loss": mse}
        for k in range(len(self.top_orders)):
            metrics[f"order_{k}"] = new_state["orders"][:, k].to(dtype)
        for key in ("coefficients", "dof", "saturated", "refused"):
            metrics[key] = new_state[key].to(dtype)
        # The state stays finite: a non-finite state is rolled back by the engine, and a
        # refused sensor then kept its zero initial coefficients and was scored as a number
        # (the fleet mean). Its refusal lives in "refused"; personalize makes it NaN again.
        new_state = {k: torch.nan_to_num(v, nan=0.0) for k, v in new_state.items()}
        return ClientResult({}, new_state, metrics)

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        return server  # nothing is uploaded

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        """The fitted surface; a refused sensor's coefficients are NaN (never a number)."""
        out = {key: state[key] for key in ("coef", "orders", "lo", "hi")}
        refused = (state["refused"] > 0.5).unsqueeze(-1)
        out["coef"] = torch.where(refused, torch.nan, out["coef"])
        return out

    def client_status(self, server: Tree, personal: Tree, x: Tensor, mask: Tensor) -> dict:
        """A refused sensor (module doc: too few points for any surface) is "refused"."""
        return {Status.REFUSED: ~torch.isfinite(personal["coef"]).all(-1)}

    def predict(self, params: Tree, x: Tensor) -> Tensor:
        """Σ a_α Π_k L̃_{α_k}(u_k) per client: (clients, rows, 1) in the dtype of ``x``.

        Beyond the sensor's calibrated box widened by ``RANGE_MARGIN`` of each input's span
        on each side (|u_k| > 1.1) the surface continues along its
        tangent plane at the box's edge (:func:`~fedcal.models.basis.linearized_products`),
        not as an order-4 polynomial; those rows are :meth:`beyond_support`.
        """
        u = to_unit_interval(x.to(F64), params["lo"], params["hi"])
        design = tensor_design(u, self.exponents)
        beyond = (u.abs() > 1.0 + 2 * RANGE_MARGIN).any(-1)
        if any_beyond(beyond):
            terms = [tuple(t) for t in self.exponents.tolist()]
            edge = torch.full((u.shape[-1],), 1.0 + 2 * RANGE_MARGIN, dtype=F64)
            guarded, _ = linearized_products(u, terms, -edge, edge)
            design = torch.where(beyond.unsqueeze(-1), guarded, design)
        return (design * params["coef"].unsqueeze(1)).sum(-1, keepdim=True).to(x.dtype)

    def beyond_support(self, params: Tree, x: Tensor) -> Tensor:
        """(clients, rows) bool: rows outside the sensor's calibrated box (linearized)."""
        u = to_unit_interval(x.to(F64), params["lo"], params["hi"])
        return (u.abs() > 1.0 + 2 * RANGE_MARGIN).any(-1)
