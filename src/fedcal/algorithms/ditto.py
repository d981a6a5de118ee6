"""Ditto (Li, Hu, Beirami, Smith, ICML 2021, Algorithm 1).

Two models per client: the global model w, trained exactly as in FedAvg, and
a personal model v_i that solves the regularized local problem (eq. 2)

    min_v  F_i(v) + λ/2 · ‖v − w^t‖²

by local SGD: per round, client i

1. runs E local epochs of SGD on F_i from the received w^t and uploads the
   result (the global objective, as FedAvg);
2. runs ``personal_epochs`` epochs of SGD on v_i with the proximal term,
   v_i ← v_i − η(∇F_i(v_i) + λ(v_i − w^t)) — anchored at the *received*
   w^t, as in the paper's Algorithm 1 — and keeps v_i (never uploaded).

Server: w^{t+1} = mean of the uploads (or sample-weighted). Client i's model
is v_i; v_i starts from the initial global model w^0.

Defaults: the paper tunes λ per data set over a small grid; we take λ = 0.1
(ours: a mild pull — calibration clients have hundreds of rows each, so the
local optimum is well determined; with our lr 0.05 any λ < 2/lr = 40 keeps
the explicit proximal step stable). ``personal_epochs`` = 5: the paper gives
the personal solver the same number of local iterations as the global one
(our ``local_epochs`` default). λ = 0 makes v_i plain local training; λ → ∞ pins v_i to w^t.
The two solvers draw independent minibatch orders (streams 0 and 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import Field

from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.data import ClientData
from fedcal.core.local import Proximal, ProximalWeight
from fedcal.core.tree import Tree

GLOBAL_STREAM, PERSONAL_STREAM = 0, 1


@dataclass(frozen=True)
class Ditto(Algorithm):
    lam: ProximalWeight = 0.1
    personal_epochs: Annotated[int, Field(ge=0)] = 5

    name = "ditto"

    def client_init(self, down: Tree) -> Tree:
        return {"personal": down["model"]}

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        anchor = down["model"]  # w^t
        # Step 1: the global model, as FedAvg.
        trained, loss = self.local_train(anchor, data, stream=GLOBAL_STREAM)

        # Step 2: the personal model with the proximal pull λ/2·‖v − w^t‖².
        personal, personal_loss = self.local_train(
            state["personal"],
            data,
            epochs=self.personal_epochs,
            stream=PERSONAL_STREAM,
            penalty=Proximal(anchor, self.lam) if self.lam else None,
        )
        return ClientResult(
            {"model": trained},
            {"personal": personal},
            {"train_loss": loss, "personal_loss": personal_loss},
        )

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        return state["personal"]
