"""A unit calibrated later from a prior with a ``discrepancy`` (issue 33): its σ.

The model is :mod:`fedcal.prior.discrepancy` (D1–D4), learned by the fleet's reference
units (:mod:`fedcal.algorithms.fedprior_deploy`). ``fedcal calibrate`` (:func:`deployed`)
adds to each new unit's parameters what D2–D4 need at any query point: its design rows
X_D, the smoother A, β, a², ℓ and the factor κ(n_i)² s_i² (t/1.96)² (:func:`deploy_shapes`);
:meth:`~fedcal.algorithms.fedprior.FedPrior.predictive_std` applies them
(:func:`deployed_var`), so ``predict``'s ``_std``, the run's coverage and the Python API
state the same σ.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fedcal.core.bayes import F64
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree
from fedcal.models.basis import legendre_products
from fedcal.prior.design_span import reliance, reliance_gram, span_reasons
from fedcal.prior.discrepancy import (
    AMP_RATIO_MAX,
    MAX_POINTS,
    Discrepancy,
    DiscrepancyError,
    deployed_units,
    deployed_variance,
    prior_distance,
    smoother,
    smoother_q,
    unit_factor,
)

DEPLOY_ROWS = MAX_POINTS  # a calibrated unit carries at most this many design rows (D2)


def prior_in_use(down: Tree) -> tuple[Tensor, Tensor]:
    """(Σ, μ) of the broadcast restricted to the basis in use (terms outside it: 0)."""
    sigma, mu = down["sigma"].to(F64), down["mu"].to(F64)
    if "mask" in down:
        m = down["mask"].to(F64)
        sigma, mu = sigma * m.unsqueeze(-1) * m.unsqueeze(-2), mu * m
    return sigma, mu


def deploy_shapes(rows: int, inputs: int, terms: int) -> dict[str, tuple[int, ...]]:
    """A deployed unit's extra parameters (D2–D4): its design rows, A, κ² s_i² (t/1.96)², a², ℓ."""
    return {
        "gp_x": (rows, inputs),
        "gp_mask": (rows,),
        "gp_a": (rows, terms),
        "gp_scale": (),
        "gp_amp": (),
        "gp_beta": (),
        "gp_len": (inputs,),
    }


def deployed_var(alg, params: Tree, x: Tensor, var: Tensor) -> Tensor:
    """D2–D4 at query rows ``x`` (units, rows, d): κ² s_i² (t/1.96)² (β v_c + σ_i² + a² q),
    v_c = ``var`` − σ_i² (the basis part of the model's own variance ``var``)."""
    phi = legendre_products(x.to(F64), alg.terms)
    lengths = params["gp_len"].to(F64).unsqueeze(-2)
    q = smoother_q(x, phi, params["gp_x"], params["gp_mask"], params["gp_a"], lengths)
    col = {
        k: params[k].to(F64).reshape(-1, 1) for k in ("noise_var", "gp_beta", "gp_amp", "gp_scale")
    }
    return deployed_variance(
        var, col["noise_var"], col["gp_beta"], col["gp_amp"], q, col["gp_scale"]
    )


def deploy_terms(
    alg, model: Discrepancy, down: Tree, personal: Tree, data: ClientData, names: list[str]
) -> tuple[Tree, list[str]]:
    """A unit calibrated from the prior: its :func:`deploy_shapes` parameters, and per unit
    the reason its design is declined ("" if spanned: D5–D6,
    :func:`~fedcal.prior.design_span.span_reasons`)."""
    rows = alg.deploy_rows
    x, y, mask = data.x.to(F64), data.y[..., 0].to(F64), data.mask.to(F64)
    c, r = mask.shape
    pad = max(rows - r, 0)
    xd = torch.nn.functional.pad(x, (0, 0, 0, pad))[:, :rows]
    km = torch.nn.functional.pad(mask, (0, pad))[:, :rows]
    z = alg.design(x, data.branch).to(F64)
    zd = torch.nn.functional.pad(z, (0, 0, 0, pad))[:, :rows] * km.unsqueeze(-1)
    yd = torch.nn.functional.pad(y, (0, pad))[:, :rows]
    cov = personal["cov"].to(F64)
    noise = personal["noise_var"].to(F64).reshape(-1).expand(c)
    p = len(alg.terms)
    lengths = torch.tensor(model.lengths, dtype=F64)
    sigma, mu = prior_in_use(down)
    resid = (yd - (zd * mu.unsqueeze(1)).sum(-1)) * km
    d2 = prior_distance(zd, model.beta * sigma, noise, xd, km, model.amplitude, lengths, resid)
    scale = unit_factor(model, km.sum(1), d2)  # D3: κ(n), D4: s_i², t
    gram = reliance_gram(model.box_lo, model.box_hi, alg.terms)
    u = reliance(cov[..., :p, :p], noise, gram)  # D6
    reasons = span_reasons(model, x, mask, names, u, noise)
    out = {
        "gp_x": xd,
        "gp_mask": km,
        "gp_a": smoother(zd, cov[..., :, :p], noise, km),
        "gp_scale": scale,
        "gp_amp": torch.full((c,), model.amplitude, dtype=F64),
        "gp_beta": torch.full((c,), model.beta, dtype=F64),
        "gp_len": lengths.expand(c, -1).clone(),
    }
    return out, reasons


def deployed(alg, raw: dict, down: Tree, personal: Tree, data: ClientData, names: list[str]):
    """``personal`` of units calibrated from a prior with a ``discrepancy`` (``raw``, checked:
    one-line errors), and per unit the reason it gets no σ ("" if it gets one).

    fedprior's own interval (I2–I4) stands wherever it states one: a unit of a design the
    federation held out for (the mixed-fleet path) keeps exactly the σ the run gives it.
    The discrepancy model (D2–D4) fills the gap where fedprior declines for want of a
    learned design: a unit smaller than the fleet's probe, a prior whose fleet had no
    few-point unit (reference units only: any unit of up to :data:`DEPLOY_ROWS` points,
    whose I4 τ² the references learned on their own 384-point rows; one of more than the
    model's ``max_points``, the largest design emulated, is declined with its reason), or
    no unit that held
    out / no τ² that covered. There the unit's design is judged (D5–D6, :func:`span_reasons`):
    spanned, it gets D2–D4's σ (I2's τ² replaced by it); not spanned, no σ and the reason.
    Declines for other causes (no residual degrees of freedom, weakly identified directions, I4's
    own-row τ² not found) stand."""
    model = Discrepancy.from_dict(raw)
    fleet_noise = float(down["noise_var"].to(F64).reshape(-1)[0])
    if not model.amplitude <= AMP_RATIO_MAX * fleet_noise:
        raise DiscrepancyError(
            f"prior.json: discrepancy.amplitude: {model.amplitude!r} exceeds "
            f"{AMP_RATIO_MAX:g} × the prior's noise variance {fleet_noise:g} (the range learned)"
        )
    extra, reasons = deploy_terms(alg, model, down, personal, data, names)
    n, probe = data.count.to(F64), down["probe_n"].to(F64).reshape(-1)
    code = down["declined"].to(F64).reshape(-1)
    # a prior without a probe (reference units only): I2/I4 learned nothing for any design
    # of up to DEPLOY_ROWS (I4's τ² is the 384-point references' on their own rows); beyond
    # the model's max_points span_reasons declines (κ(n) not learned there)
    weak = alg.weak_units(down, personal["cov"], personal["noise_var"], data)
    own = personal.get("declined", torch.zeros(data.num_clients, dtype=F64)) > 0
    use = deployed_units(n, probe, code, own, weak, DEPLOY_ROWS)
    off = torch.zeros_like(extra["gp_amp"])
    extra["gp_amp"] = torch.where(use, extra["gp_amp"], off)
    extra["gp_scale"] = torch.where(use, extra["gp_scale"], off + 1.0)
    extra["gp_beta"] = torch.where(use, extra["gp_beta"], off + 1.0)
    out = {**personal, **extra}
    if "disc_var" in out:
        out["disc_var"] = torch.where(use, 0.0, out["disc_var"])
    spanned = torch.tensor([not r for r in reasons])
    out["declined"] = torch.where(use, ~spanned, own).to(F64)
    return out, [why if bool(u) else "" for u, why in zip(use, reasons, strict=True)]
