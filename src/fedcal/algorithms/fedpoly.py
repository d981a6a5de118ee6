"""Federated polynomial calibration: private low-order terms, fleet-shared curvature (ours).

The per-sensor polynomial (``polynomial.py``) needs as many calibration points
as it has coefficients. Across a fleet of one design, sensors differ mostly in
offset, sensitivity and their first temperature terms; the higher-order shape
of the surface comes from the shared physics. So split the Legendre surface

    P_i(f, T) = Σ_{k ∈ L} b_{i,k} φ_k(f, T)  +  Σ_{k ∈ S} s_k φ_k(f, T),
    φ_k = P̃_a(f)·P̃_c(T)  (normalized Legendre products, scaled inputs),

into private terms L (the head φ, never sent) and shared terms S (the body ω),
and solve the joint least-squares problem min_{s, b_1..b_N} Σ_i ‖y_i − X_{L,i} b_i
− X_{S,i} s‖²_{W_i} exactly, by variable projection (FedPer's split, solved in
closed form instead of by gradient steps):

1. client i eliminates its private terms: with M_i = X_{L,i}ᵀ W_i X_{L,i} + εI,
   Z_i = X_{S,i} − X_{L,i} M_i⁻¹ X_{L,i}ᵀ W_i X_{S,i} and
   z_i = y_i − X_{L,i} M_i⁻¹ X_{L,i}ᵀ W_i y_i (shared design and target with
   the private part projected out), and uploads A_i = Z_iᵀ W_i Z_i and
   r_i = Z_iᵀ W_i z_i (the Schur complement of its normal equations);
2. server: s = (Σ_i A_i + εI)⁻¹ Σ_i r_i — the shared terms of the joint
   optimum (a sum: independent of client order);
3. each client's b_i = M_i⁻¹ X_{L,i}ᵀ W_i (y_i − X_{S,i} s) (``personalize``).

One round gives the exact joint solution; later rounds repeat it (the
uploads depend only on the data). What leaves a client: a k_S × k_S Gram
matrix of its projected shared design (where its calibration points lie) and
a k_S-vector — never its points or its private coefficients.

Default split (ours, measured): private 1, f, T, f·T, f², T², f²·T — offset,
sensitivity and their temperature dependence, the first non-linearity — and
shared the other nine terms up to orders (3, 3). It needs more calibration
points per sensor than private terms (7); with 6 points use 3 private terms
(1, f, T). On the simulated fleet it reaches the noise floor with 12 points
per sensor, where the per-sensor polynomial is 30× worse (docs/results/fedpoly.md).

**Weak sensors** (issue 20). A sensor with fewer points than private terms, or points
that do not tell them apart (two temperatures cannot see T²), leaves directions u of its
private coefficients with uᵀX_LᵀWX_Lu below ``NULL_REL`` × the largest eigenvalue: the ridge
ε sets them (to 0), not its data, and no other unit informs a private term. The sensor is
``weak`` when its private design at the inputs it is evaluated at has more than
``NULL_SHARE`` (1 %) of its norm along them (:mod:`fedcal.core.identify`, the per-sensor
``leastsq``'s rule): e.g. every 6-point unit with the default 7 private terms (docs/statuses.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from fedcal.core.algorithm import Algorithm, ClientResult, SettingError
from fedcal.core.data import ClientData
from fedcal.core.identify import NULL_SHARE, null_projector, null_share
from fedcal.core.robust import explained_rms, gram_problems
from fedcal.core.task import Task
from fedcal.core.tree import Tree, leaves
from fedcal.models.basis import legendre
from fedcal.status import Status

F64 = torch.float64


def legendre_design(x: Tensor, terms: tuple[tuple[int, int], ...]) -> Tensor:
    """φ_k(f, T) for each term (a, c) of ``terms``: (..., rows, 2) → (..., rows, len(terms))."""
    x = x.to(F64)
    top_f = max((a for a, _ in terms), default=0)
    top_t = max((c for _, c in terms), default=0)
    pf, pt = legendre(x[..., 0], top_f), legendre(x[..., 1], top_t)
    if not terms:
        return x.new_zeros(*x.shape[:-1], 0)
    return torch.stack([pf[a] * pt[c] for a, c in terms], dim=-1)


@dataclass(frozen=True)
class FedPoly(Algorithm):
    @property
    def uses_local_epochs(self) -> bool:  # closed form
        return False

    private_terms: tuple[tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)]], ...] = (
        (0, 0),
        (1, 0),
        (0, 1),
        (1, 1),
        (2, 0),
        (0, 2),
        (2, 1),
    )
    # shared = every other product up to these orders
    max_orders: tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)]] = (3, 3)
    # ε: keeps an under-determined sensor (fewer points than terms) well-posed
    ridge: Annotated[float, Field(ge=0.0)] = 1e-6

    name = "fedpoly"
    uploads = ("statistics",)  # Gram matrix A_i and r_i of the projected design

    reply_aggregation = "sum"  # Σ of Gram matrices and right-hand sides

    def screen_view(
        self, replies: dict[str, Tensor], rows: Tensor, broadcast: Tree
    ) -> dict[str, Tensor]:
        """What the size screen judges (issue 34.3): the RMS of the unit's own fit of its
        projected target by the shared terms, √(r_iᵀA_i⁺r_i / n_i), in the units of y
        (:func:`fedcal.core.robust.explained_rms`), not A_i and r_i: their size grows with
        the unit's inputs (a shared term x³T³ of 3 honest readings at 3× the range made
        A_i 3·10⁴ × the fleet's and the unit was rejected), not with a lie. Targets × f
        give f × its value; A_i is checked for being a Gram (positive semi-definite)."""
        return {"fit_rms": explained_rms(replies["gram"], replies["rhs"], rows)}

    def inconsistent_replies(
        self, server: Tree, replies: Tree, weights: Tensor, accepted: Tensor
    ) -> dict[int, str] | None:
        """A projected Gram A_i that is not positive semi-definite cannot be Z_iᵀW_iZ_i."""
        idx = accepted.nonzero()[:, 0]
        whys = gram_problems(replies["gram"].index_select(0, idx), None, constant_first=False)
        return {int(idx[j]): why for j, why in sorted(whys.items())}

    def __post_init__(self) -> None:
        # A TOML config gives lists; terms are compared as tuples.
        object.__setattr__(self, "private_terms", tuple(tuple(t) for t in self.private_terms))
        object.__setattr__(self, "max_orders", tuple(self.max_orders))

    def check_task(self, task: Task) -> None:
        bad = [
            t for t in self.private_terms if t[0] > self.max_orders[0] or t[1] > self.max_orders[1]
        ]
        if bad:
            raise SettingError(
                "max_orders, private_terms", f"terms {bad} exceed max_orders {self.max_orders}"
            )
        if getattr(task.model, "in_features", 2) != 2:
            raise ValueError("fedpoly calibrates two inputs (frequency, temperature)")

    @property
    def shared_terms(self) -> tuple[tuple[int, int], ...]:
        private = set(self.private_terms)
        p, q = self.max_orders
        return tuple((a, c) for c in range(q + 1) for a in range(p + 1) if (a, c) not in private)

    def _private_fit(self, shared: Tensor, data: ClientData) -> Tensor:
        """Step 1: b_i given s, per client (clients, k_L)."""
        w = data.mask.to(F64).unsqueeze(-1)
        x_l = legendre_design(data.x, self.private_terms)
        x_s = legendre_design(data.x, self.shared_terms)
        y = data.y[..., 0].to(F64) - (x_s * shared.unsqueeze(1)).sum(-1)
        gram = x_l.transpose(1, 2) @ (w * x_l)
        eye = torch.eye(len(self.private_terms), dtype=F64)
        return torch.linalg.solve(
            gram + self.ridge * eye, (x_l * w).transpose(1, 2) @ y.unsqueeze(-1)
        )[..., 0]

    # ---- the contract ----------------------------------------------------
    def server_init(self, params: Tree) -> Tree:
        return {"shared": torch.zeros(len(self.shared_terms), dtype=F64)}

    def client_init(self, down: Tree) -> Tree:
        n = leaves(down)[0].shape[0]
        return {"private": torch.zeros(n, len(self.private_terms), dtype=F64)}

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        w = data.mask.to(F64).unsqueeze(-1)
        x_l = legendre_design(data.x, self.private_terms)
        x_s = legendre_design(data.x, self.shared_terms)
        y = data.y.to(F64)
        # Step 1: project the private terms out of the shared design and the target.
        eye = torch.eye(len(self.private_terms), dtype=F64)
        m = x_l.transpose(1, 2) @ (w * x_l) + self.ridge * eye
        both = torch.cat([x_s, y], -1)
        projected = both - x_l @ torch.linalg.solve(m, (x_l * w).transpose(1, 2) @ both)
        z_s, z_y = projected[..., :-1], projected[..., -1:]
        reply = {
            "gram": z_s.transpose(1, 2) @ (w * z_s),  # A_i
            "rhs": (z_s * w).transpose(1, 2).matmul(z_y)[..., 0],  # r_i
        }
        b = self._private_fit(down["shared"], data)
        pred = self.predict({"private": b, "shared": down["shared"]}, data.x)
        mse = ((pred - data.y).pow(2).mean(-1) * data.mask).sum(1) / data.mask.sum(1).clamp_min(1)
        return ClientResult(reply, {"private": b}, {"train_loss": mse})

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        # Sum in a canonical order (sorted by the replies themselves): the solve can be
        # ill-conditioned, and then the rounding of the sum must not depend on arrival order.
        order = torch.from_numpy(np.lexsort(replies["rhs"].numpy().T[::-1]).copy())
        gram = replies["gram"][order].sum(0)
        eye = torch.eye(gram.shape[0], dtype=F64)
        shared = torch.linalg.solve(gram + self.ridge * eye, replies["rhs"][order].sum(0))
        return {**server, "shared": shared}

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        # Refit the private terms against the final shared terms (the last half-sweep);
        # null: the projector onto the private directions its points do not determine.
        x_l = legendre_design(data.x, self.private_terms)
        gram = x_l.transpose(1, 2) @ (data.mask.to(F64).unsqueeze(-1) * x_l)
        private = self._private_fit(down["shared"], data)
        return {"private": private, "shared": down["shared"], "null": null_projector(gram)}

    def client_status(self, server: Tree, personal: Tree, x: Tensor, mask: Tensor) -> dict:
        """``weak``: the private design's share along the sensor's undetermined private
        directions at ``x`` exceeds ``NULL_SHARE`` (module doc, "Weak sensors")."""
        if "null" not in personal:
            return {}
        design = legendre_design(x, self.private_terms)
        return {Status.WEAK: null_share(design, personal["null"], mask) > NULL_SHARE}

    def predict(self, params: Tree, x: Tensor) -> Tensor:
        value = (legendre_design(x, self.private_terms) * params["private"].unsqueeze(1)).sum(-1)
        value = value + (legendre_design(x, self.shared_terms) * params["shared"].unsqueeze(1)).sum(
            -1
        )
        return value.unsqueeze(-1).to(x.dtype)
