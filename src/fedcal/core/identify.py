"""Which directions of a linear-in-parameters model its data do not determine (status "weak").

Two rules, shared by every method that can state them cheaply and exactly
(docs/statuses.md, "weak"):

* **A fit's own null space** (per-sensor least squares, fedpoly's private terms). The
  directions u of coefficient space with uᵀX_iᵀX_iu below ``NULL_REL`` × the largest
  eigenvalue of X_iᵀX_i are set by the ridge (to 0), not by the unit's points.
  :func:`null_projector` is the projector P_i onto them; :func:`null_share` the share of
  the design's norm along them at the rows a unit is evaluated at,

      s_i = Σ_rows ‖P_i x‖² / Σ_rows ‖x‖²,

  and the unit is weak when s_i > ``NULL_SHARE`` (1 %): its predictions there rest on a
  zero the data never checked.
* **A fleet prior's unlearned directions** (fedprior, FedGMI's Bayesian head). The
  summed data support Σ_i [I − (I + s²G_i/σ²)⁻¹] (:func:`fedcal.core.bayes.data_support`)
  counts, per direction, the units whose own points determine it; those counted fewer than
  ``min_informed`` times (:func:`unlearned_directions`, orthonormal columns W) keep the
  vague start. :func:`unlearned_share` is the share of a unit's predictive variance that
  its coefficients along them explain, the variance knowing Wᵀc would remove,

      Var(φᵀc) − Var(φᵀc | Wᵀc) = (φᵀV_iW)(WᵀV_iW)⁻¹(WᵀV_iφ),
      s_i = Σ_rows (φᵀV_iW)(WᵀV_iW)⁻¹(WᵀV_iφ) / Σ_rows (φᵀV_iφ + σ_i²)   (0 ≤ s_i ≤ 1),

  and the unit is weak when s_i > ``UNLEARNED_SHARE`` (one half): its number is mostly
  the starting prior's, not a calibration. (When V_i has no covariance between W and the
  rest this is Σ_rows (φᵀW)(WᵀV_iW)(Wᵀφ) / Σ_rows (φᵀV_iφ + σ_i²); with covariance that
  projection is not a part of the variance: a unit whose points determine φᵀc had it
  10⁵ × its whole predictive variance, docs/statuses.md.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from fedcal.core.bayes import F64, predictive_var

NULL_REL = 1e-8  # an eigenvalue of XᵀX below this × the largest: not determined by the points
NULL_SHARE = 0.01  # a fit is weak when its null space carries this share of the design's norm
UNLEARNED_SHARE = 0.5  # a prior's unit is weak when unlearned directions carry this of its σ²


def null_projector(gram: Tensor) -> Tensor:
    """P_i (…, p, p): the projector onto eigenvectors of ``gram`` (…, p, p) with eigenvalue
    below ``NULL_REL`` × its largest (the directions the points do not determine)."""
    vals, vecs = torch.linalg.eigh(gram.to(F64))
    low = (vals < NULL_REL * vals[..., -1:].clamp_min(0.0)).to(F64).unsqueeze(-2)
    return (vecs * low) @ vecs.transpose(-1, -2)


def null_share(design: Tensor, projector: Tensor, mask: Tensor) -> Tensor:
    """(clients,) Σ_rows ‖P_i x‖² / Σ_rows ‖x‖² over the rows ``mask`` marks; ``design``
    (clients, rows, p), ``projector`` (clients, p, p) from :func:`null_projector`."""
    design = design.to(F64) * mask.to(F64).unsqueeze(-1)
    along = ((design @ projector.to(F64)) ** 2).sum((1, 2))
    return along / (design**2).sum((1, 2)).clamp_min(1e-300)


def unlearned_directions(support: Tensor, min_informed: float) -> Tensor:
    """W (p, k): orthonormal eigenvectors of the summed support (p, p) that fewer than
    ``min_informed`` units determine (k = 0: every direction is learned)."""
    vals, vecs = torch.linalg.eigh(0.5 * (support + support.T).to(F64))
    return vecs[:, vals < min_informed]


def unlearned_share(
    design: Tensor, cov: Tensor, noise_var: Tensor, weak: Tensor, mask: Tensor
) -> Tensor:
    """(clients,) the share of each unit's predictive variance that its coefficients along
    ``weak`` (p, k) explain (module doc),

    Σ_rows (φᵀV_iW)(WᵀV_iW)⁺(WᵀV_iφ) / Σ_rows (φᵀV_iφ + σ_i²), over the rows ``mask`` marks;
    ``design`` φ (clients, rows, p), ``cov`` V_i (clients, p, p), ``noise_var`` (clients,).
    The pseudo-inverse: W need not have full column rank (fedprior passes W's rows of φ).
    A unit whose V_i or σ_i² is not finite (diverged) gets NaN, so no ``share > t`` flag:
    its status is the divergence rule's (the eigensolver raises on it, stopping the run)."""
    design, cov, weak = design.to(F64), cov.to(F64), weak.to(F64)
    noise_var = noise_var.to(F64).reshape(-1)
    finite = torch.isfinite(cov).flatten(1).all(1) & torch.isfinite(noise_var)
    safe = torch.where(finite[:, None, None], cov, torch.zeros((), dtype=F64))
    cross = design @ (safe @ weak)  # (clients, rows, k): φᵀV_iW
    inner = weak.T @ safe @ weak  # (clients, k, k): WᵀV_iW
    inv = torch.linalg.pinv(0.5 * (inner + inner.transpose(-1, -2)), hermitian=True, rtol=1e-12)
    along = ((cross @ inv) * cross).sum(-1)
    total = predictive_var(design, safe, torch.where(finite, noise_var, 1.0))
    m = mask.to(F64)
    share = (along * m).sum(1) / (total * m).sum(1).clamp_min(1e-300)
    return torch.where(finite, share, torch.nan)
