"""Per-sensor polynomial calibration: the manufacturers' least-squares surface.

Not federated: every sensor is fitted alone on its own calibration points, the
way resonant barometers are characterised today (e.g. the Digiquartz
calibration equations, or a polynomial surface fitted to a chamber sweep):

    P = Σ_{i ≤ p, j ≤ q} a_ij · f^i · T^j

with f the pressure-resonator frequency and T the temperature. We fit on the
scaled inputs and target (an affine change of f, T or P maps the span of
{f^i T^j, i ≤ p, j ≤ q} onto itself, so the fitted surface is the same).

Steps per client (closed form, batched over the cohort, float64 inside):

1. the orders (p, q) come from k-fold cross-validation over the grid
   p ∈ ``min_f_order``…``max_f_order``, q ∈ 0…``max_t_order`` — only orders with
   fewer coefficients than the rows of every training fold are eligible; the
   folds are a seeded shuffle of the rows (``data.seeds``); the choice is the
   *smallest* model whose CV RMSE is within ``cv_tolerance`` (relative) plus
   ``cv_floor`` (absolute, scaled units) of the best, so that a surface that
   fits exactly is not traded for a bigger one that also fits exactly;
   ``orders=(p, q)`` fixes them instead;
2. the coefficients are the least-squares solution on all rows, with a tiny
   ridge ``ridge·‖a‖²`` for numerical safety, solved as an augmented
   least-squares problem by QR (no normal equations: the monomial basis is
   ill-conditioned enough that squaring its condition number would cost
   digits); one QR per fold serves every candidate order (see
   :func:`triangularize`);
3. the fit is kept: a client that has been fitted keeps its coefficients in
   later rounds (the method is idempotent — one round suffices).

The personal "model" is the coefficient vector over the full basis
(``(max_f_order+1)·(max_t_order+1)`` monomials, zero outside the chosen
orders) and the chosen orders, so this algorithm brings its own ``predict``.

Defaults (ours): orders up to f⁴ and T³ — the Digiquartz equation is, for
small x, close to a low-order surface in period and temperature, and cubic
temperature terms are what calibration sheets carry; 5 folds, the usual
choice; tolerance 1 % — a parsimony rule in the spirit of the one-standard-
error rule, which avoids chasing noise with extra coefficients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.data import ClientData, sample_rows
from fedcal.core.tree import Tree, leaves

FOLD_STREAM = 0  # the seeded shuffle that assigns rows to folds


def monomials(x: Tensor, exponents: Tensor) -> Tensor:
    """The basis f^i·T^j of inputs ``x`` (..., rows, 2) → (..., rows, terms), float64.

    ``exponents`` (terms, 2) holds (i, j) per term.
    """
    x = x.to(torch.float64)
    f, t = x[..., 0:1], x[..., 1:2]
    return f.pow(exponents[:, 0].to(torch.float64)) * t.pow(exponents[:, 1].to(torch.float64))


def triangularize(
    design: Tensor, target: Tensor, rows: Tensor, ridge: float
) -> tuple[Tensor, Tensor]:
    """QR of the ridge-augmented system over the selected rows: (R, Qᵀb).

    design (..., R, B); target (..., R); rows (..., R) 0/1. With
    [design; √ridge·I] = Q·R, every least-squares problem on a subset S of the
    columns reduces to min ‖R[:, S]·a_S − Qᵀb‖ (B rows instead of R): one QR
    per fold serves every candidate order.
    """
    size = design.shape[-1]
    penalty = torch.eye(size, dtype=design.dtype).mul(ridge**0.5)
    stacked = torch.cat(
        [design * rows.unsqueeze(-1), penalty.expand(*design.shape[:-2], -1, -1)], -2
    )
    rhs = torch.cat([target * rows, torch.zeros(*target.shape[:-1], size, dtype=design.dtype)], -1)
    q, r = torch.linalg.qr(stacked)
    return r, (q.transpose(-1, -2) @ rhs.unsqueeze(-1)).squeeze(-1)


def solve_on_terms(r: Tensor, qtb: Tensor, terms: Tensor) -> Tensor:
    """argmin over a zero outside ``terms`` (..., B) of ‖r·a − qtb‖: a (..., B).

    Unselected columns are zeroed and pinned to 0 by one extra row each, so
    the system stays full rank and the selected coefficients are the exact
    least-squares solution on those columns.
    """
    batch = torch.broadcast_shapes(r.shape[:-2], terms.shape[:-1])
    pin = torch.diag_embed(1.0 - terms)
    a = torch.cat(
        [(r * terms.unsqueeze(-2)).expand(*batch, -1, -1), pin.expand(*batch, -1, -1)], -2
    )
    b = torch.cat([qtb.expand(*batch, -1), torch.zeros_like(terms).expand(*batch, -1)], -1)
    solution = torch.linalg.lstsq(a, b.unsqueeze(-1), driver="gels").solution.squeeze(-1)
    return solution * terms


@dataclass(frozen=True)
class PolynomialCalibration(Algorithm):
    min_f_order: int = 1
    max_f_order: int = 4
    max_t_order: int = 3
    orders: tuple[int, int] | None = None  # fixed (p, q) instead of cross-validation
    folds: int = 5
    cv_tolerance: float = 0.01
    cv_floor: float = 1e-9
    ridge: float = 1e-12

    name = "polynomial"
    uploads = ()
    federated = False

    def __post_init__(self) -> None:
        if not 0 <= self.min_f_order <= self.max_f_order or self.max_t_order < 0:
            raise ValueError("need 0 ≤ min_f_order ≤ max_f_order and max_t_order ≥ 0")
        if self.orders is not None:
            p, q = self.orders
            if not (0 <= p <= self.max_f_order and 0 <= q <= self.max_t_order):
                raise ValueError(f"orders {self.orders} outside the basis")
        if self.folds < 2:
            raise ValueError("folds must be at least 2")

    # ---- the basis and the candidate orders ----------------------------
    @property
    def exponents(self) -> Tensor:
        """(terms, 2): every (i, j) with i ≤ max_f_order, j ≤ max_t_order."""
        return torch.tensor(
            [(i, j) for i in range(self.max_f_order + 1) for j in range(self.max_t_order + 1)]
        )

    @property
    def candidates(self) -> list[tuple[int, int]]:
        """Orders to choose from, fewest coefficients first (ties: lower f order)."""
        if self.orders is not None:
            return [tuple(self.orders)]
        grid = [
            (p, q)
            for p in range(self.min_f_order, self.max_f_order + 1)
            for q in range(self.max_t_order + 1)
        ]
        return sorted(grid, key=lambda pq: ((pq[0] + 1) * (pq[1] + 1), pq[0]))

    def term_masks(self, orders: list[tuple[int, int]]) -> Tensor:
        """(len(orders), terms) 0/1: which monomials each (p, q) uses."""
        e = self.exponents
        return torch.stack([((e[:, 0] <= p) & (e[:, 1] <= q)).to(torch.float64) for p, q in orders])

    # ---- step 1: orders by k-fold cross-validation ---------------------
    def choose_orders(self, data: ClientData) -> Tensor:
        """Index into :attr:`candidates` per client (clients,)."""
        grid = self.candidates
        if len(grid) == 1:
            return torch.zeros(data.num_clients, dtype=torch.int64)
        shuffled = sample_rows(data, 1.0, FOLD_STREAM)  # seeded permutation of each client's rows
        design = monomials(shuffled.x, self.exponents)  # (clients, R, B)
        target = shuffled.y[..., 0].to(torch.float64)  # (clients, R)
        real = shuffled.mask.to(torch.float64)  # (clients, R)
        fold_of_row = torch.arange(design.shape[1]) % self.folds  # (R,)
        masks = self.term_masks(grid)  # (G, B)
        sse = torch.zeros(len(grid), data.num_clients, dtype=torch.float64)
        fewest_train_rows = torch.full((data.num_clients,), float("inf"), dtype=torch.float64)
        for k in range(self.folds):
            held_out = real * (fold_of_row == k)
            train_rows = real - held_out
            r, qtb = triangularize(design, target, train_rows, self.ridge)
            coef = solve_on_terms(r, qtb, masks[:, None, :])  # (G, clients, B)
            pred = (design.unsqueeze(0) * coef.unsqueeze(-2)).sum(-1)  # (G, clients, R)
            sse = sse + ((pred - target).pow(2) * held_out).sum(-1)
            fewest_train_rows = torch.minimum(fewest_train_rows, train_rows.sum(-1))
        cv_rmse = (sse / real.sum(-1).clamp_min(1.0)).sqrt()  # (G, clients)
        sizes = masks.sum(-1, keepdim=True)  # (G, 1)
        cv_rmse = torch.where(sizes < fewest_train_rows, cv_rmse, torch.inf)
        best = cv_rmse.min(0).values
        good_enough = cv_rmse <= best * (1.0 + self.cv_tolerance) + self.cv_floor
        return good_enough.to(torch.int8).argmax(0)  # first = fewest coefficients

    # ---- the contract ----------------------------------------------------
    def client_init(self, down: Tree) -> Tree:
        n = leaves(down)[0].shape[0]
        terms = len(self.exponents)
        return {
            "coef": torch.zeros(n, terms, dtype=torch.float64),
            "orders": torch.zeros(n, 2, dtype=torch.float64),
            "fitted": torch.zeros(n, dtype=torch.float64),
        }

    def fit(self, data: ClientData) -> tuple[Tensor, Tensor]:
        """Steps 1–2: coefficients (clients, terms) and orders (clients, 2)."""
        choice = self.choose_orders(data)
        terms = self.term_masks(self.candidates)[choice]  # (clients, B)
        design = monomials(data.x, self.exponents)
        target = data.y[..., 0].to(torch.float64)
        r, qtb = triangularize(design, target, data.mask.to(torch.float64), self.ridge)
        coef = solve_on_terms(r, qtb, terms)
        orders = torch.tensor(self.candidates, dtype=torch.float64)[choice]
        return coef, orders

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        coef, orders = self.fit(data)
        # Step 3: a fitted sensor keeps its calibration (idempotent over rounds).
        done = state["fitted"].unsqueeze(1) > 0.5
        coef = torch.where(done, state["coef"], coef)
        orders = torch.where(done, state["orders"], orders)
        new_state = {"coef": coef, "orders": orders, "fitted": torch.ones_like(state["fitted"])}
        params = self.personalize(down, new_state, data)
        pred = self.predict(params, data.x)
        mse = ((pred - data.y).pow(2).mean(-1) * data.mask).sum(1) / data.mask.sum(1).clamp_min(1)
        metrics = {
            "train_loss": mse,
            "f_order": orders[:, 0].to(data.x.dtype),
            "t_order": orders[:, 1].to(data.x.dtype),
        }
        return ClientResult({}, new_state, metrics)

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        return server  # nothing is uploaded

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        return {"coef": state["coef"], "orders": state["orders"]}

    def predict(self, params: Tree, x: Tensor) -> Tensor:
        """Σ a_ij f^i T^j per client: (clients, rows, 1) in the dtype of ``x``."""
        design = monomials(x, self.exponents)
        return (design * params["coef"].unsqueeze(1)).sum(-1, keepdim=True).to(x.dtype)
