"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar & Smith, MLSys 2020).

Client k, given the global model w^t, approximately minimizes its proximal
objective h_k (§3)

    h_k(w; w^t) = F_k(w) + μ/2·‖w − w^t‖²

by E epochs of minibatch SGD (the paper's inexact local solver), i.e. each
step is w ← w − η·(∇F_k(w; batch) + μ·(w − w^t)); the server averages the
uploads as FedAvg does (Algorithm 2). μ = 0 is FedAvg.

Default μ = 0.01: from the paper's grid {0.001, 0.01, 0.1, 0.5, 1} (and the
value of the survey seed 002's code example); our scaled regression has
gradients of order 1, so μ = 0.01 is a gentle pull. Device heterogeneity
(variable local work) is not simulated: every client runs E full epochs.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.data import ClientData
from fedcal.core.local import Proximal, ProximalWeight
from fedcal.core.tree import Tree


@dataclass(frozen=True)
class FedProx(Algorithm):
    mu: ProximalWeight = 0.01

    name = "fedprox"

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        global_model = down["model"]
        trained, loss = self.local_train(
            global_model, data, penalty=Proximal(global_model, self.mu)
        )
        return ClientResult({"model": trained}, state, {"train_loss": loss})
