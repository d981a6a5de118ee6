"""Each new unit's posterior under a stored prior (:func:`calibrate`): the closed form the
federation computes, with the unit's own noise level settled by the federation's fixed
point (the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedcal.algorithms.fedprior import FedPrior
from fedcal.algorithms.fedprior_deployed import deployed
from fedcal.calibration.rebuild import prior_algorithm, prior_server
from fedcal.core.bayes import F64
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree, expand
from fedcal.data.fleet import Fleet
from fedcal.engine.simulation import FleetTensors
from fedcal.prior import qa
from fedcal.prior.discrepancy import Discrepancy
from fedcal.prior.discrepancy import expected_scale as discrepancy_scale
from fedcal.prior.model import PriorModel

NOISE_ITERATIONS = 25  # fixed-point iterations of a unit's own noise level (converged: tested)


@dataclass(frozen=True)
class Calibration:
    algorithm: FedPrior
    tensors: FleetTensors
    personal: Tree
    server: Tree
    reasons: tuple[str, ...] = ()  # per unit, why its design gets no σ ("" if it gets one)
    refused: tuple[qa.Refusal, ...] = ()  # units the range guard refused (no model, not here)


def calibrate(
    prior: PriorModel, fleet: Fleet, source: str = "data", strict: bool = False
) -> Calibration:
    """Each unit's posterior under the stored prior (see the package docstring); a unit
    outside the prior's range refused alone (``strict``: the whole file), as the station
    does (:func:`fedcal.prior.qa.refuse_out_of_range`)."""
    qa.check_columns(prior, fleet, source)  # the station's checks
    fleet, refused = qa.refuse_out_of_range(prior, fleet, source, strict)
    algorithm = prior_algorithm(prior, source, timed=fleet.row_times("train") is not None)
    scaler = prior.scaler

    def scaled(split: str) -> ClientData:
        arrays = [(scaler.x(x), scaler.y(y)) for x, y in fleet.arrays(split)]
        # A prior with a direction term reads the file's sweep directions (none: b = 0).
        return ClientData.from_arrays(
            arrays, dtype=F64, branch=fleet.branch_signs(split), time=fleet.row_times(split)
        )

    tensors = FleetTensors(
        scaled("train"), scaled("test"), scaler, tuple(map(str, fleet.client_ids))
    )
    server = prior_server(prior, scaler)
    reasons: list[str] = []
    personal = unit_posteriors(
        algorithm,
        server,
        tensors.train,
        discrepancy=prior.discrepancy,
        names=prior.features,
        reasons=reasons,
    )
    return Calibration(algorithm, tensors, personal, server, tuple(reasons), refused)


def unit_posteriors(
    algorithm: FedPrior,
    server: Tree,
    data: ClientData,
    noise_var: torch.Tensor | None = None,
    discrepancy: dict | None = None,
    names: tuple[str, ...] = (),
    reasons: list[str] | None = None,
    expected: bool = False,
) -> Tree:
    """Each unit's posterior under the stored prior, with what its σ is made of.

    The one place a unit's stated σ is formed off the federation on the torch path:
    :func:`calibrate` calls it on a unit's readings, the planner's torch path
    (:class:`fedcal.planning_torch.TorchForecaster`, for the variants
    :func:`fedcal.prior.posterior.unsupported` names; the others are planned in NumPy by
    :func:`fedcal.prior.posterior.calibrate_units`) on a design's expected readings, so the
    σ ``plan`` forecasts is the σ ``calibrate`` states (a term added here reaches both: the
    prior's ``discrepancy`` model, issue 33, with the features' ``names`` for its reasons,
    appended to ``reasons``). ``noise_var``
    None: each unit's own noise level, the fixed point of :func:`own_noise`; given (the
    planner: the fleet's σ²): that level — the fixed point's value for the fleet's
    typical unit, since under the prior predictive E[rss_i] = n_i σ² (rss_i = ‖y − Φm‖² +
    tr(ΦVΦᵀ) = σ⁴tr(C⁻¹) + n_iσ² −
    σ⁴tr(C⁻¹) in expectation, C = ΦΣΦᵀ + σ²I), so σ_i² = (rss_i + νσ²)/(n_i + ν) = σ².
    ``expected``: the rows are a new unit's design read at the prior mean (the planner), so
    the discrepancy model's per-unit scale is taken at its expectation (:func:`expected_scale`).
    """
    n = data.num_clients
    down = expand(algorithm.broadcast(server), n)
    state = algorithm.client_init(down)
    if noise_var is None:
        state = own_noise(algorithm, down, state, data)
    else:
        state["noise_var"] = noise_var.to(F64).expand(n).clone()
    personal = algorithm.personalize(down, state, data)
    if algorithm.deploy_rows and discrepancy is not None:  # issue 33 (fedprior_deployed)
        personal, why = deployed(algorithm, discrepancy, down, personal, data, list(names))
        if reasons is not None:  # per unit, why its design gets no σ ("" if it gets one)
            reasons.extend(why)
        if expected:  # the planner's new unit, read at the prior mean: its expected scale
            personal = expected_scale(personal, Discrepancy.from_dict(discrepancy))
    return personal


def expected_scale(personal: Tree, model: Discrepancy) -> Tree:
    """The planner's units with the discrepancy model's per-unit scale at its expectation.

    D4 (:mod:`fedcal.prior.discrepancy`): s_i² = (ν₀ + d_i²)/(ν₀ + n_i), d_i² = rᵀC⁻¹r of
    the unit's readings about the prior mean, E[d_i²] = n_i under the model, so
    E[s_i²] = 1 if units spread as the model says; new units read farther from the prior
    than that (issue 33: d² ≈ 126 over 6 points on cross-check seed 3), so the references'
    emulation records the mean s² of its emulated units per design size
    (``mean_scale2``, E4c). The planner reads a design at the current mean (r = 0 on its
    new rows): its s_i² would be ν₀/(ν₀ + n_i). So the forecast takes κ² · (t/1.96)² with
    s_i² = E[s²](n_i): s_i² at d² = 0 divided out and the recorded mean put in
    (:func:`fedcal.prior.discrepancy.expected_scale`, the NumPy planner's too; a record
    without it: 1; ν₀ = ∞: s_i² = 1 already; a unit without the model's σ, ``gp_amp`` 0:
    untouched).
    """
    if "gp_scale" not in personal:
        return personal
    args = (personal["gp_scale"], personal["gp_amp"], personal["gp_mask"])
    return {**personal, "gp_scale": discrepancy_scale(model, *args)}


def own_noise(algorithm: FedPrior, down: Tree, state: Tree, data: ClientData) -> Tree:
    """The unit's noise level under the fixed prior: NOISE_ITERATIONS steps of the
    federation's fixed point σ_i² = (r_i + νσ²)/(n_i + ν) (:meth:`FedPrior.client_update`).

    Only the state of ``client_update`` is used here, so only its posterior and noise step
    are computed, on moments formed once: the same operations on the same inputs as
    ``client_update``'s (the same bits, tested), without the M-step terms it also uploads.
    """
    if algorithm.select != "none":  # candidates' noise levels too: the whole client step
        for _ in range(NOISE_ITERATIONS):
            state = algorithm.client_update(down, state, data).state
        return state
    full = algorithm._client_moments(down, data)  # fedprior_drift: whitened by its q
    for _ in range(NOISE_ITERATIONS):
        if algorithm.noise != "sensor":  # one fleet σ²: the state does not move
            break
        _, post = algorithm._posterior(down, state, full)
        state = {**state, "noise_var": algorithm._sensor_noise(post.rss, full.n, down["noise_var"])}
    return state
