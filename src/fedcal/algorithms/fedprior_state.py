"""The fleet prior's trees as its parts make them up: the server's start, its broadcast, a
round's sums and the server's new state (one EM's, or every candidate's); a unit's personal
tree's shapes.

The equations are :mod:`fedcal.algorithms.fedprior`'s (step 2, the M-step: μ, Σ, σ² from the
sums is ``FedPrior._prior_update``, passed in, so that every candidate runs the same one);
here is what each part adds around them. Every function takes the parts
(:class:`~fedcal.algorithms.fedprior_parts.FedPriorParts`), whose fields are the settings they
read, and what else it reads explicitly. Imports the parts, never ``fedprior.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from fedcal.algorithms.fedprior_deployed import deploy_shapes
from fedcal.algorithms.fedprior_interval import INTERVAL_KEYS
from fedcal.algorithms.fedprior_parts import FedPriorParts
from fedcal.algorithms.fedprior_robust import capped_noise, weighted
from fedcal.algorithms.fedprior_stream import canonical_order
from fedcal.core.bayes import F64
from fedcal.core.robust import OutlierWeights
from fedcal.core.tree import Tree

NOISE_KEYS = ("noise_gamma", "noise_gamma_fit", "noise_student")  # γ and the tail's (N2–N6)


def server_start(parts: FedPriorParts, init_scale: float, init_noise: float) -> Tree:
    """The server before round 0: the vague start μ = 0, Σ = s²I (s = ``init_scale``), σ² =
    ``init_noise``², no support yet, and each part's state."""
    p = parts.branch_pins.features
    start = {
        "mu": torch.zeros(p, dtype=F64),
        "sigma": init_scale**2 * torch.eye(p, dtype=F64),
        "noise_var": torch.tensor(init_noise**2, dtype=F64),
        "support": torch.zeros(p, p, dtype=F64),
    }
    if parts.calibrated.interval == "calibrated":
        start.update(parts.calibrated.init())
    start.update(parts.noise_model.init(parts.support_box.inputs))  # γ, the tail's test (N2–N6)
    if parts.selection.branch_orders:  # ψ coordinates out of the model (none yet): BranchPins
        start["pinned"] = torch.zeros(p, dtype=F64)
    if parts.time_choice.on:  # fedprior_choice's pooled lines and summed scores
        start.update(parts.time_choice.init())
    start.update(parts.rounds_schedule.init())  # R1–R3's bookkeeping (none when off)
    # the selection's (fedprior_candidates C1): round 0 screens with the largest candidate
    return {**start, "box": parts.support_box.open_box(), **parts.candidate_ems.init(start)}


def broadcast(parts: FedPriorParts, server: Tree) -> Tree:
    """What the server sends each unit: the prior (μ, Σ, σ²) and each part's keys."""
    down = {k: server[k] for k in ("mu", "sigma", "noise_var")}
    if "box" in server:  # the fleet's input support (extrapolation guard)
        down["box"] = server["box"]
    down.update({k: server[k] for k in INTERVAL_KEYS if k in server})
    down.update({k: server[k] for k in NOISE_KEYS if k in server})
    if "pinned" in server:  # ψ coordinates out of the model (BranchPins.unidentified)
        down["pinned"] = server["pinned"]
    if parts.selection.select != "none":
        down["mask"] = server["mask"]
    if "pooled_ok" in server:  # the fleet's pooled lines (fedprior_choice), once summed
        keys = parts.time_choice.forward.broadcast_keys
        down.update({k: server[k] for k in keys if k in server})
    if "holdout_now" in server:  # fedprior_rounds R2: whether this round holds out
        down["holdout_now"] = server["holdout_now"]
    down.update(parts.candidate_ems.broadcast(server))  # (fedprior_candidates C1)
    return down


def personal_shapes(parts: FedPriorParts, deploy_rows: int) -> dict[str, tuple[int, ...]]:
    """One sensor's personal tree (``FedPrior.personalize``): the shapes a loaded model file
    must have."""
    p, inputs = parts.branch_pins.features, parts.support_box.inputs
    # box: the unit's input support (lo, hi per input), the extrapolation guard's
    shapes = {"coef": (p,), "cov": (p, p), "noise_var": (), "box": (2, inputs)}
    if parts.calibrated.interval == "calibrated":  # τ_i² and whether its interval is declined
        shapes.update(disc_var=(), declined=())
    if parts.noise_model.noise_shape == "inputs":  # γ of σ²(x) = σ_i² exp(γᵀx) (fedprior_noise)
        shapes["noise_gamma"] = (inputs,)
    if parts.time_choice.choose != "off":  # the no-harm fall-back, the validation MSE
        shapes.update(fallback=(), val_mse=(), sigma_scale=(), target_sd=())
        shapes.update(parts.time_choice.forward.shapes())  # κ, ρ/T after calibration
    if deploy_rows:  # the unit's design for the prior's discrepancy σ (fedprior_deploy)
        shapes.update(deploy_shapes(deploy_rows, inputs, parts.branch_pins.phi_terms))
    return shapes


def export_state(parts: FedPriorParts, server: Tree, note: str) -> dict:
    """The fleet prior (:meth:`PriorStatus.export_state`, ``note``: why no interval is stated
    for some units) with the time-respecting choice's record (fedprior_choice)."""
    state = parts.prior_status.export_state(server, note)
    record = parts.time_choice.record(server)
    if record is not None:
        selection = state.setdefault("selection", {"rule": "none", "chosen": {}})
        if parts.candidate_ems.on:
            selection["rule"] = "forward"
        selection["forward"] = record
    return state


class RoundSums(NamedTuple):
    """One round's server-side sums, as both M-step paths (one EM, every candidate) read them."""

    server: Tree
    replies: Tree
    order: Tensor
    total: dict
    count: Tensor
    metric: Tensor
    pinned: Tensor
    forward: Tree | None


def round_sums(
    parts: FedPriorParts,
    server: Tree,
    replies: Tree,
    units: Tensor | None,
    robust: OutlierWeights | None,
) -> RoundSums:
    """The sums step 2 reads: every unit counts once (a hierarchical model's units are its
    samples), times its ``robust`` weight, in a canonical order so that the rounding does not
    depend on arrival order; ``units``: N when the replies are already summed
    (fedprior_stream), else their count."""
    order = canonical_order(replies["mean"])
    if robust is not None and bool((robust.weights != 1).any()):  # all 1: the plain sums
        replies = weighted(replies, robust.weights)
    if parts.robust_uploads.robust != "off":  # residual sums: a bounded pull on σ², no screen
        replies = capped_noise(replies)
    skip = ("cand", "interval", "noise", "choice")
    forward = None
    if "choice" in replies:  # per unit unless already summed (fedprior_stream)
        choice = (replies["choice"], order, replies["gram"], units is None)
        forward = parts.time_choice.update(*choice)
    total = {k: v[order].sum(0) for k, v in replies.items() if k not in skip}
    pinned = parts.branch_pins.unidentified(total.pop("branch_support", None))
    if "interval" in replies:  # the restricted noise update's sums (I1)
        total.update({k: replies["interval"][k][order].sum(0) for k in ("dof", "fit")})
    count = torch.tensor(float(replies["mean"].shape[0]), dtype=F64) if units is None else units
    if robust is not None:  # Σ w_i units (exactly N when every weight is 1)
        count = robust.weights[order].sum() if bool((robust.weights != 1).any()) else count
    metric = total["gram"] / total["n"].clamp_min(1.0)
    return RoundSums(server, replies, order, total, count, metric, pinned, forward)


def next_server(parts: FedPriorParts, sums: RoundSums, prior_update: Callable) -> Tree:
    """The server after a round: one EM's update, or every candidate's while they run (R1:
    not once the choice is frozen); ``prior_update`` is the M-step."""
    if not parts.candidate_ems.running(sums.replies):
        return one_em(parts, sums, prior_update)
    return every_candidate(parts, sums, prior_update)


def one_em(parts: FedPriorParts, sums: RoundSums, prior_update: Callable) -> Tree:
    """The server update of one EM: without selection, under ``select_by = "marginal"``,
    or the chosen candidate's once the choice is frozen (fedprior_rounds R1)."""
    server, replies, order, total, count, metric, pinned, forward = sums
    frozen = parts.candidate_ems.on  # R1: the chosen EM alone, in its own design metric
    if frozen:
        metric = parts.candidate_ems.frozen_metric(server, metric)
    mu, sigma, noise_var = parts.branch_pins.restart(server, pinned, total["gram"]) or prior_update(
        server["mu"], total, count, metric, server["noise_var"], pinned
    )
    new = {"mu": mu, "sigma": sigma, "noise_var": noise_var, "support": total["support"]}
    new["box"] = parts.support_box.fleet_box(total["gram"])
    if frozen:  # the choice as frozen
        new.update(parts.candidate_ems.frozen(server))
    elif parts.selection.select != "none":  # select_by = "marginal": the noisy-BIC choice
        new.update(parts.selection.marginal_choice(total["select"], count, pinned))
    if "noise" in replies:  # γ's step and test, the tail's test (fedprior_noise, N2–N6)
        noise = replies["noise"]
        new.update(parts.noise_model.updates(server, noise, order, total["n"], replies["n"]))
    new.update(parts.time_choice.kept(server, forward))
    if parts.selection.branch_orders:  # the features in use, without ψ's coordinates out
        new["mask"] = new.get("mask", parts.selection.masks[-1]) * (~pinned).to(F64)
        new["pinned"] = pinned.to(F64)
    new.update(parts.calibrated.update(server, replies, order, total))
    return new


def every_candidate(parts: FedPriorParts, sums: RoundSums, prior_update: Callable) -> Tree:
    """The server update while every candidate's EM runs (``select = "bic"``): each
    candidate's M-step and the fleet's BIC choice (fedprior_candidates C3, C4), or the
    time-respecting choice by each unit's future."""
    server, replies, order, total, count, metric, pinned, forward = sums
    cand = {k: v[order].sum(0) for k, v in replies["cand"].items()}
    args = (server, cand, total, count, metric, pinned, prior_update)
    stacked = parts.candidate_ems.m_steps(*args)  # C3, then C4 (fedprior_candidates)
    scores, choice, same = parts.candidate_ems.choice(cand, count, pinned)
    if forward is not None and float(forward["forward_scored"]) > 0:  # by each unit's future
        choice = parts.time_choice.pick(torch.where(same, math.inf, forward["forward_scores"][:-3]))
    noise = replies.get("noise")
    return {
        **parts.time_choice.kept(server, forward),
        **{key: v[choice] for key, v in stacked.items()},
        "box": parts.support_box.fleet_box(total["gram"]),
        "mask": parts.selection.masks[choice] * (~pinned).to(F64),
        **({"pinned": pinned.to(F64)} if parts.selection.branch_orders else {}),
        "choice": torch.tensor(choice),
        "scores": scores,
        "cand": stacked,
        **parts.calibrated.update(server, replies, order, total),
        **(
            {}
            if noise is None
            else parts.noise_model.updates(server, noise, order, total["n"], replies["n"])
        ),
    }
