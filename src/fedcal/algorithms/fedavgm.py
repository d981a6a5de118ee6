"""FedAvgM: FedAvg with server momentum (Hsu, Qi & Brown, 2019, "Measuring the
effects of non-identical data distribution for federated visual classification").

Clients run FedAvg's local training from w^t and upload their models. The
server treats the average model change as a pseudo-gradient (paper §3):

    Δ^t = w^t − Σ_i p_i w_i^{t+1},    v^{t+1} = β·v^t + Δ^t,    w^{t+1} = w^t − η·v^{t+1},

with v^0 = 0. The momentum buffer v stays on the server: only the model is
broadcast. β = 0, η = 1 is FedAvg.

Defaults: β = 0.9 (the paper's standard server momentum); the paper reports
its results against the effective learning rate η/(1 − β) and we set
η = 1 − β = 0.1, so η_eff = 1: in a steady state (constant Δ) the server
moves as far per round as plain FedAvg does, while momentum smooths the
heterogeneous round-to-round direction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import Field
from torch import Tensor

from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree, sub, tree_map, zeros_like


@dataclass(frozen=True)
class FedAvgM(Algorithm):
    server_momentum: Annotated[float, Field(ge=0.0)] = 0.9
    server_lr: Annotated[float, Field(ge=0.0)] = 0.1

    name = "fedavgm"

    def server_init(self, params: Tree) -> Tree:
        return {"model": params, "velocity": zeros_like(params)}

    def broadcast(self, server: Tree) -> Tree:
        return {"model": server["model"]}

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        trained, loss = self.local_train(down["model"], data)
        return ClientResult({"model": trained}, state, {"train_loss": loss})

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        average = super().server_update(server, replies, weights)["model"]
        delta = sub(server["model"], average)  # the pseudo-gradient Δ^t
        velocity = tree_map(lambda v, d: self.server_momentum * v + d, server["velocity"], delta)
        model = tree_map(lambda w, v: w - self.server_lr * v, server["model"], velocity)
        return {"model": model, "velocity": velocity}
