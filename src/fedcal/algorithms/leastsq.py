"""Least-squares polynomial references for generic inputs: per sensor, or pooled over the fleet.

Reference lines for any number of inputs (the ``polynomial`` method is
written for two, frequency and temperature). The model is a total-degree
polynomial in the scaled inputs x ∈ ℝ^F:

    y ≈ Σ_{|e| ≤ d} c_e · x^e,   x^e = Π_j x_j^{e_j}   (C(F + d, d) terms; F = 3, d = 2: 10)

(``family = "monomial"``, the default; any registered basis family of
:mod:`fedcal.models.basis` gives the same span with other terms, e.g. ``"legendre"``.)

* ``pooled = false`` (per-sensor fit, not federated): each sensor solves its own
  ridge-regularized normal equations (X_iᵀX_i + λI) c_i = X_iᵀy_i on its
  calibration points; with fewer points than terms λ → 0 picks the
  minimum-norm interpolant, i.e. it overfits — what a per-unit fit does
  with few points.
* ``pooled = true`` (one fleet-wide fit, federated): each client uploads its
  Gram matrix X_iᵀX_i and moment X_iᵀy_i; the server solves
  (Σ_i X_iᵀX_i + λI) c = Σ_i X_iᵀy_i — exactly the least-squares fit of all
  points pooled (sum of sufficient statistics, so no point leaves a client)
  and every sensor uses c: the non-personalized reference.

Closed form: one round suffices and later rounds repeat it.

**Screening the pooled uploads** (issue 20 item 3). X_iᵀX_i is a function of the unit's
inputs only — a 4th moment of them for degree 2 — and it, like X_iᵀy_i, grows with a unit's
rows and input range: honest units differ in it by 10²–10³ (a sensor that sees pollution
episodes). The size screen therefore judges one scale-free quantity instead
(:meth:`LeastSquares.screen_view`): the RMS of the unit's own fit, √(m_iᵀG_i⁺m_i / n_i)
(:func:`fedcal.core.robust.explained_rms`, in the units of y); the Gram and the count are
checked for consistency (:meth:`LeastSquares.inconsistent_replies`: G_i PSD, G_00 = count
= the declared rows). A unit whose targets are ×1000 has a fit RMS ×1000 and is rejected.

**Weak sensors** (per-sensor fit). Directions of coefficient space that a sensor's own
points do not determine — eigenvectors u of X_iᵀX_i with eigenvalue below ``NULL_REL`` ×
the largest (e.g. the T² term on a design with two temperatures) — are set by the ridge to
0, not by data. The fit keeps the projector P_i = Σ u uᵀ over them (``personalize``:
``null``); a sensor is ``weak`` (:meth:`LeastSquares.client_status`) when at the inputs it
is evaluated at the undetermined part of the design carries more than ``NULL_SHARE`` of its
norm, Σ_rows ‖P_i x^e‖² / Σ_rows ‖x^e‖² > NULL_SHARE: its predictions there rest on a zero
the data never checked (the rule of :mod:`fedcal.core.identify`, shared with fedpoly).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Annotated

import torch
from pydantic import AfterValidator, Field
from torch import Tensor

from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.data import ClientData
from fedcal.core.identify import NULL_REL as NULL_REL  # re-exported (docs)
from fedcal.core.identify import NULL_SHARE, null_projector, null_share
from fedcal.core.robust import count_problems, explained_rms, gram_problems
from fedcal.core.tree import Tree
from fedcal.models.basis import basis_family
from fedcal.models.basis import monomial_products as monomial_design  # noqa: F401 (re-exported)
from fedcal.status import Status

F64 = torch.float64


def total_degree_exponents(num_inputs: int, degree: int) -> Tensor:
    """(terms, num_inputs): every exponent vector with sum ≤ degree, by degree, then lexical."""
    rows = [
        e
        for d in range(degree + 1)
        for e in sorted(itertools.product(range(d + 1), repeat=num_inputs), reverse=True)
        if sum(e) == d
    ]
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), num_inputs)


def _registered(name: str) -> str:
    basis_family(name)  # a one-line ValueError naming the known families
    return name


@dataclass(frozen=True)
class LeastSquares(Algorithm):
    @property
    def uses_local_epochs(self) -> bool:  # closed form
        return False

    degree: Annotated[int, Field(ge=0)] = 2
    pooled: bool = False
    ridge: Annotated[float, Field(gt=0.0)] = 1e-8  # λ, relative to the number of points (safety)
    # the basis family of the terms (fedcal.models.basis.FAMILIES): x^e, or e.g. "legendre"
    family: Annotated[str, AfterValidator(_registered)] = "monomial"

    name = "leastsq"
    uploads = ("statistics",)  # pooled: Gram sums; per sensor nothing leaves the client
    one_shot = True  # closed form: later rounds repeat round 1 (module doc)
    # The server sums the statistics (Σ G_i, Σ X_iᵀy_i, Σ n_i). Declared "mean" before
    # (issue 34), the adaptive clip scaled the largest units' sums by a factor < 1: 4 of
    # 16 channels of the gas network, pooled RMSE 109 ppm instead of the exact fit's 95.8.
    # Sums are screened (their fit RMS) and checked, never clipped (core/aggregation.py).
    reply_aggregation = "sum"

    @property
    def federated(self) -> bool:  # type: ignore[override]
        """Pooled uploads sufficient statistics; a per-sensor fit communicates nothing."""
        return self.pooled

    @property
    def exponents(self) -> Tensor:
        return total_degree_exponents(self.task.model.in_features, self.degree)

    def design(self, x: Tensor) -> Tensor:
        """The terms at ``x`` in the configured family: (..., rows, F) → (..., rows, terms)."""
        return basis_family(self.family).products(x, self.exponents)

    def _statistics(self, data: ClientData) -> tuple[Tensor, Tensor, Tensor]:
        """Per client: XᵀWX (clients, B, B), XᵀWy (clients, B), row count (clients,)."""
        design = self.design(data.x)
        w = data.mask.to(F64).unsqueeze(-1)
        gram = design.transpose(1, 2) @ (w * design)
        moment = ((w * design) * data.y[..., :1].to(F64)).sum(1)
        return gram, moment, data.mask.to(F64).sum(1)

    def _solve(self, gram: Tensor, moment: Tensor, count: Tensor) -> Tensor:
        eye = torch.eye(gram.shape[-1], dtype=F64)
        lam = self.ridge * count.clamp_min(1.0)
        return torch.linalg.solve(gram + lam[..., None, None] * eye, moment)

    # ---- the contract ----------------------------------------------------
    def server_init(self, params: Tree) -> Tree:
        return {"coef": torch.zeros(len(self.exponents), dtype=F64)}

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        gram, moment, count = self._statistics(data)
        reply = {"gram": gram, "moment": moment, "count": count} if self.pooled else {}
        params = self.personalize(down, state, data)
        err = (self.predict(params, data.x) - data.y).pow(2).mean(-1)
        mse = (err * data.mask).sum(1) / data.mask.sum(1).clamp_min(1)
        return ClientResult(reply, state, {"train_loss": mse})

    def screen_view(
        self, replies: dict[str, Tensor], rows: Tensor, broadcast: Tree
    ) -> dict[str, Tensor]:
        """What the size screen judges (module doc): the unit's own fit RMS, not its sums."""
        return {"fit_rms": explained_rms(replies["gram"], replies["moment"], rows)}

    def inconsistent_replies(
        self, server: Tree, replies: Tree, weights: Tensor, accepted: Tensor
    ) -> dict[int, str] | None:
        """Unscreened sums checked instead (module doc): count = declared rows, G PSD with
        G_00 = count (the first monomial is the constant, x^0 = 1); None: nothing uploaded."""
        if not self.pooled:
            return None
        idx = accepted.nonzero()[:, 0]
        count = replies["count"].index_select(0, idx)
        whys = gram_problems(replies["gram"].index_select(0, idx), count, constant_first=True)
        for j, why in count_problems(count, weights.index_select(0, idx)).items():
            whys.setdefault(j, why)
        return {int(idx[j]): why for j, why in sorted(whys.items())}

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        if not self.pooled:
            return server
        total = {k: v.sum(0) for k, v in replies.items()}
        return {**server, "coef": self._solve(total["gram"], total["moment"], total["count"])}

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        if self.pooled:
            return {"coef": down["coef"]}
        gram, moment, count = self._statistics(data)
        # P_i: the undetermined directions (module doc)
        return {"coef": self._solve(gram, moment, count), "null": null_projector(gram)}

    def client_status(self, server: Tree, personal: Tree, x: Tensor, mask: Tensor) -> dict:
        """``weak``: the design's share along the sensor's undetermined directions at ``x``
        exceeds NULL_SHARE (module doc); a pooled fit: none."""
        if "null" not in personal:
            return {}
        design = self.design(x)
        return {Status.WEAK: null_share(design, personal["null"], mask) > NULL_SHARE}

    def predict(self, params: Tree, x: Tensor) -> Tensor:
        """Σ_e c_e x^e per client: (clients, rows, 1) in the dtype of ``x``."""
        design = self.design(x)
        return (design * params["coef"].unsqueeze(1)).sum(-1, keepdim=True).to(x.dtype)
