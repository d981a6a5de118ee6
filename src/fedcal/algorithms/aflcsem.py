"""AFL-CSEM — adaptive number of local steps τ under a resource budget (seed 004).

Jiang et al., "Adaptive Federated Learning Based Crowd Sensing Algorithm for
Environmental Monitoring", Acta Electronica Sinica 53(3), 2025 (the control law
follows Wang et al., IEEE JSAC 2019). Equation numbers are the paper's.

Local step (5): w_i ← w_i − η∇F_i(w_i) on a minibatch (``batch_size`` rows; a
batch at least as large as the local set gives the paper's full gradient);
η = ``lr``. One engine round is one aggregation interval [k] of τ local steps.

Participant (algorithm 3): receives w(t0) and τ*; evaluates F_i(w(t0)) (1) and
∇F_i(w(t0)) on its whole local set; runs τ* local steps → w_i(t); records Q_i,
the samples it trained since the last aggregation, and its per-sample time c_i
and energy e_i; estimates (lines 7–8)
    ρ_i = |F_i(w_i) − F_i(w)| / ‖w_i − w‖,   β_i = ‖∇F_i(w_i) − ∇F_i(w)‖ / ‖w_i − w‖.
Our pair of points is (w(t0), w_i(t)) of the same round, so no model has to be
kept between rounds (the paper uses the previous local model and the new
global one; both are secant estimates of the same constants). It uploads
w_i, Q_i, c_i, e_i, F_i(w(t0)), ∇F_i(w(t0)), ρ_i, β_i.

Server (algorithm 2), one call per interval:
* F(w(t0)) by (2) (line 11) from the uploaded F_i(w(t0)); keep the best model
  w^f = argmin F (8) (lines 12–13);
* aggregate w(t) = Σ Q_i w_i / Q (7) (line 8);
* resources of the interval, (9)–(11): C = Σ c_i Q_i + c, E = Σ e_i Q_i + e,
  M_all += S·C + (1 − S)·E;
* estimates (lines 16–20): ρ = Σ Q_i ρ_i / Q, β = Σ Q_i β_i / Q,
  ∇F(w) = Σ Q_i ∇F_i(w) / Q, δ_i = ‖∇F_i(w) − ∇F(w)‖ (13), δ = Σ Q_i δ_i / Q (14);
* h(τ) = δ/β·((ηβ + 1)^τ − 1) − ηδτ (20);
  R(τ) = (P − a − b) / (τ·a + b) (35), the affordable aggregations with
  a = Σ_i (S c_i + (1 − S) e_i)·q_i the cost of one local step of all participants
  (q_i = Q_i/τ samples per step) and b = S c + (1 − S) e the cost of one aggregation
  (the "− a − b" in the numerator are the "+1" terms of (9)–(10): the extra round
  that evaluates the last model). (35) is garbled in the source; this is its
  dimensionally consistent reading;
  G(τ) = 1/(2ηφRτ) + sqrt(1/(4η²φ²R²τ²) + ρh(τ)/(ηφτ)) + ρh(τ) (36);
  τ* = argmin G over τ ∈ 1..min(τ_max, γ·τ_prev) by linear search (37) (line 21;
  γ = ``search_growth``, the seed's search range γ = 10, as in Wang et al.);
* budget (lines 23–25): if the next interval plus the final evaluation
  (a + b) would exceed P, τ* is cut to the largest affordable value and the STOP
  flag is set; the interval after it is the last; then one evaluation-only round
  (τ = 0: participants only report F_i of the last model, lines 27–31) and the
  server switches to w^f and stops changing: later rounds are idempotent.

Stages kept in ``server["stage"]``: 0 running, 1 STOP flag set (last interval
under way), 2 final evaluation pending, 3 stopped (``server["stopped"]`` = 1).
The cost of the first interval (τ = 1) is only known after it (participants
report c_i, e_i); the budget must cover it and the final evaluation.

Costs: participant i's (c_i, e_i) are drawn once, at its first participation,
from N(mean, std²) (the paper: "resource consumption drawn from Gaussians"),
truncated below at 10 % of the mean, seeded by the client's round seed, and kept
in its private state. The aggregation costs (c, e) of the CSP are fixed fields.
Our defaults (the seed gives none): per-sample time and energy 2e-5 ± 5e-6,
aggregation 0.05 each, so that the seed's budget P = 15 affords ≈ 1000 local
steps on the default fleet (20 sensors, batch 32) and one aggregation costs
about as much as 4 local steps. Seed values: P = 15, τ_max = 100, γ = 10,
φ = 0.025 (SVM), S = 0.5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.data import ClientData, minibatch_steps
from fedcal.core.local import GradFn, train
from fedcal.core.tree import Tree, sq_norm, sub, tree_map, weighted_mean

RUNNING, LAST_INTERVAL, FINAL_EVALUATION, STOPPED = 0, 1, 2, 3
COST_STREAM = 17  # seed stream of the cost draws (independent of the batch plans)
F64 = torch.float64


def model_gap(tau: Tensor, eta: float, beta: Tensor, delta: Tensor) -> Tensor:
    """h(τ) = δ/β·((ηβ + 1)^τ − 1) − ηδτ (20); its β → 0 limit is 0."""
    beta = torch.as_tensor(beta, dtype=F64).clamp_min(1e-300)
    growth = torch.expm1(tau * torch.log1p(eta * beta)) / beta  # ((ηβ + 1)^τ − 1)/β
    return (delta * (growth - eta * tau)).clamp_min(0.0)


def affordable_aggregations(
    tau: Tensor, budget: float, step_cost: float, aggregation_cost: float
) -> Tensor:
    """R(τ) = (P − a − b)/(τ·a + b) (35): aggregations the budget affords at τ steps each."""
    return (budget - step_cost - aggregation_cost) / (tau * step_cost + aggregation_cost)


def control_objective(
    tau: Tensor,
    eta: float,
    phi: float,
    rho: float | Tensor,
    beta: float | Tensor,
    delta: float | Tensor,
    rounds: Tensor,
) -> Tensor:
    """G(τ) (36) with R = ``rounds`` (R(τ) of (35), or a constant)."""
    tau = torch.as_tensor(tau, dtype=F64)
    r = torch.as_tensor(rounds, dtype=F64).clamp_min(1e-12)
    rho_h = torch.as_tensor(rho, dtype=F64) * model_gap(
        tau, eta, torch.as_tensor(beta, dtype=F64), torch.as_tensor(delta, dtype=F64)
    )
    first = 1.0 / (2.0 * eta * phi * r * tau)
    return first + torch.sqrt(first.pow(2) + rho_h / (eta * phi * tau)) + rho_h


def optimal_tau(
    eta: float,
    phi: float,
    rho: float | Tensor,
    beta: float | Tensor,
    delta: float | Tensor,
    budget: float,
    step_cost: float,
    aggregation_cost: float,
    tau_max: int,
) -> int:
    """τ* = argmin_{τ ∈ 1..τ_max} G(τ) (37), by linear search (ties → smallest τ)."""
    taus = torch.arange(1, tau_max + 1, dtype=F64)
    rounds = affordable_aggregations(taus, budget, step_cost, aggregation_cost)
    g = control_objective(taus, eta, phi, rho, beta, delta, rounds)
    return int(torch.argmin(g)) + 1


@dataclass(frozen=True)
class AFLCSEM(Algorithm):
    """See the module docstring for every default's origin."""

    @property
    def uses_local_epochs(self) -> bool:  # τ local steps, not epochs
        return False

    budget: Annotated[float, Field(gt=0.0)] = 15.0
    cost_weight: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5  # S
    time_per_sample: tuple[float, float] = (2e-5, 5e-6)  # c_i ~ N(mean, std²)
    energy_per_sample: tuple[float, float] = (2e-5, 5e-6)  # e_i ~ N(mean, std²)
    # A real fleet's measured (c_i, e_i), by client index; empty = draw them as above.
    participant_costs: tuple[tuple[float, float], ...] = ()
    aggregation_time: Annotated[float, Field(ge=0.0)] = 0.05  # c
    aggregation_energy: Annotated[float, Field(ge=0.0)] = 0.05  # e
    phi: Annotated[float, Field(gt=0.0)] = 0.025
    tau_max: Annotated[int, Field(ge=1)] = 100
    search_growth: Annotated[int, Field(ge=1)] = 10  # γ
    initial_tau: Annotated[int, Field(ge=1)] = 1

    name = "aflcsem"
    uploads = ("model", "gradients", "costs")  # F_i, ∇F_i, ρ_i, β_i; Q_i, c_i, e_i

    reply_aggregation = "custom"  # losses and τ-control statistics, not a plain mean

    # ---- costs ----------------------------------------------------------
    @property
    def aggregation_cost(self) -> float:
        """b = S·c + (1 − S)·e: one aggregation, in budget units."""
        s = self.cost_weight
        return s * self.aggregation_time + (1 - s) * self.aggregation_energy

    def draw_costs(self, seeds: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        """(c_i, e_i) of each client from its seed: Gaussian, truncated at 10 % of the mean."""
        draws = []
        for seed in seeds:
            rng = np.random.default_rng(np.random.SeedSequence([seed, COST_STREAM]))
            draws.append(
                [
                    max(rng.normal(*self.time_per_sample), 0.1 * self.time_per_sample[0]),
                    max(rng.normal(*self.energy_per_sample), 0.1 * self.energy_per_sample[0]),
                ]
            )
        out = torch.tensor(draws, dtype=F64).reshape(len(seeds), 2)
        return out[:, 0], out[:, 1]

    # ---- the contract -----------------------------------------------------
    def server_init(self, params: Tree) -> Tree:
        zero = torch.zeros((), dtype=F64)
        return {
            "model": params,
            "tau": torch.tensor(self.initial_tau, dtype=torch.int64),
            "best_model": params,
            "best_loss": torch.tensor(math.inf, dtype=F64),
            "spent": zero,
            "step_cost": zero,
            "aggregations": torch.zeros((), dtype=torch.int64),
            "stage": torch.tensor(RUNNING, dtype=torch.int64),
            "stopped": torch.tensor(False),
            "global_loss": zero,  # F(w(t0)) of the last evaluated model
            "estimates": {"rho": zero, "beta": zero, "delta": zero},
        }

    def broadcast(self, server: Tree) -> Tree:
        return {"model": server["model"], "tau": server["tau"]}

    def client_init(self, down: Tree) -> Tree:
        n = down["tau"].shape[0]
        unknown = torch.full((n,), -1.0, dtype=F64)
        return {"time_per_sample": unknown, "energy_per_sample": unknown.clone()}

    def client_costs(self, state: Tree, data: ClientData) -> Tree:
        """The client's (c_i, e_i): given per participant, or drawn at its first
        participation; then kept."""
        if self.participant_costs:
            if not data.index or max(data.index) >= len(self.participant_costs):
                raise ValueError(
                    f"participant_costs has {len(self.participant_costs)} entries; "
                    f"clients {list(data.index) or 'of unknown index'} have none"
                )
            given = torch.tensor([self.participant_costs[i] for i in data.index], dtype=F64)
            return {"time_per_sample": given[:, 0], "energy_per_sample": given[:, 1]}
        drawn_c, drawn_e = self.draw_costs(data.seeds)
        known = state["time_per_sample"] > 0
        return {
            "time_per_sample": torch.where(known, state["time_per_sample"], drawn_c),
            "energy_per_sample": torch.where(known, state["energy_per_sample"], drawn_e),
        }

    def local_objective(self, down: Tree) -> GradFn:
        """What the τ local steps (5) descend: F_i; a baseline may add a term (FedUCS)."""
        return self.task.value_and_grad

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        w = down["model"]
        costs = self.client_costs(state, data)
        # F_i(w(t0)), ∇F_i(w(t0)) on the whole local set (1).
        loss_w, grad_w = self.task.value_and_grad(w, data.x, data.y, data.mask)
        # τ* local steps (5); τ is read from the broadcast, the same for every client.
        batches = minibatch_steps(data, down["tau"], self.batch_size)
        w_i, train_loss = train(self.local_objective(down), w, batches, self.make_optimizer())
        samples = batches.w.sum((0, 2)).to(F64)  # Q_i
        loss_i, grad_i = self.task.value_and_grad(w_i, data.x, data.y, data.mask)
        # ρ_i, β_i (algorithm 3, lines 7–8); 0 when the model did not move.
        dist = sq_norm(sub(w_i, w)).sqrt()
        moved = dist > 0
        safe = torch.where(moved, dist, torch.ones_like(dist))
        rho = torch.where(moved, (loss_i - loss_w).abs() / safe, torch.zeros_like(dist))
        beta = torch.where(
            moved, sq_norm(sub(grad_i, grad_w)).sqrt() / safe, torch.zeros_like(dist)
        )
        reply = {
            "model": w_i,
            "samples": samples,
            "loss": loss_w,
            "grad": grad_w,
            "rho": rho,
            "beta": beta,
            **costs,
        }
        metrics = {"train_loss": train_loss, "samples": samples}
        return ClientResult(reply, costs, metrics)

    def next_tau(self, server: Tree, estimates: Tree, step_cost: float) -> int:
        """τ* of (37), searched up to min(τ_max, γ·τ_prev)."""
        upper = min(self.tau_max, self.search_growth * max(int(server["tau"]), 1))
        return optimal_tau(
            self.lr,
            self.phi,
            estimates["rho"],
            estimates["beta"],
            estimates["delta"],
            self.budget,
            step_cost,
            self.aggregation_cost,
            upper,
        )

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        stage = int(server["stage"])
        if stage == STOPPED:
            return server
        counts = weights.to(F64)
        # F(w(t0)) by (2) (line 11) and the best model w^f (8) (lines 12–13).
        loss = (counts * replies["loss"]).sum() / counts.sum()
        improved = bool(loss < server["best_loss"])
        best = {
            "best_model": server["model"] if improved else server["best_model"],
            "best_loss": loss if improved else server["best_loss"],
            "global_loss": loss,
        }
        if stage == FINAL_EVALUATION:
            # Lines 27–31: the last model was evaluated; the extra step and
            # aggregation are the "+1" terms of (9)–(10).
            spent = server["spent"] + server["step_cost"] + self.aggregation_cost
            return {
                **server,
                **best,
                "model": best["best_model"],
                "spent": spent,
                "tau": torch.zeros_like(server["tau"]),
                "stage": torch.tensor(STOPPED, dtype=torch.int64),
                "stopped": torch.tensor(True),
            }
        q = replies["samples"]
        tau = max(int(server["tau"]), 1)
        model, merges = self.aggregate(server, replies)
        s = self.cost_weight
        unit = s * replies["time_per_sample"] + (1 - s) * replies["energy_per_sample"]
        spent = server["spent"] + (unit * q).sum() + merges * self.aggregation_cost  # (9)–(11)
        step_cost = (unit * q).sum() / tau  # a: one local step of all participants
        estimates = self.estimate(replies, q)
        if stage == LAST_INTERVAL:
            stage, tau_next = FINAL_EVALUATION, 0
        else:
            tau_next = self.next_tau(server, estimates, float(step_cost))
            a, b = float(step_cost), self.aggregation_cost
            room = self.budget - float(spent) - (a + b)  # keep the final evaluation
            if tau_next * a + merges * b > room:  # lines 24–25
                tau_next = math.floor((room - merges * b) / a) if a > 0 else 0
                stage = LAST_INTERVAL if tau_next >= 1 else FINAL_EVALUATION
                tau_next = max(tau_next, 0)
        return {
            **server,
            **best,
            "model": model,
            "tau": torch.tensor(tau_next, dtype=torch.int64),
            "spent": spent,
            "step_cost": step_cost,
            "aggregations": server["aggregations"] + 1,
            "stage": torch.tensor(stage, dtype=torch.int64),
            "estimates": estimates,
        }

    def aggregate(self, server: Tree, replies: Tree) -> tuple[Tree, int]:
        """w(t) = Σ Q_i w_i / Q (7), and the number of aggregations it took (one)."""
        return weighted_mean(replies["model"], replies["samples"]), 1

    def estimate(self, replies: Tree, q: Tensor) -> Tree:
        """ρ, β, δ (algorithm 2 lines 16–20; (13)–(14)), Q-weighted."""
        share = q / q.sum()
        global_grad = weighted_mean(replies["grad"], q)
        diff = tree_map(lambda g, m: g - m.unsqueeze(0), replies["grad"], global_grad)
        delta_i = sq_norm(diff).sqrt()
        return {
            "rho": (share * replies["rho"]).sum(),
            "beta": (share * replies["beta"]).sum(),
            "delta": (share * delta_i).sum(),
        }
