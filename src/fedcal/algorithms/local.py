"""Local-only training: each sensor alone, same model, optimizer and epochs.

The reference point of personalization: nothing is shared, so a federated
method earns its keep only where it beats this. Every round each client runs
``local_epochs`` epochs on its own model; nothing is uploaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree


@dataclass(frozen=True)
class LocalOnly(Algorithm):
    name = "local"
    uploads = ()
    federated = False

    def client_init(self, down: Tree) -> Tree:
        # Same initial weights as the federated methods, then never synchronised.
        return {"model": down["model"]}

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        trained, loss = self.local_train(state["model"], data)
        return ClientResult({}, {"model": trained}, {"train_loss": loss})

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        return server

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        return state["model"]
