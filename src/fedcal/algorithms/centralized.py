"""Centralized training on pooled data: the privacy-violating reference.

What a manufacturer would do with every sensor's calibration rows in one
place: train one model on the union of the clients' data. Cast in the
federated contract so the engine can run and price it:

1. each client uploads its raw rows — the reply *is* the data (plus its row
   count and round seed), so the engine's bytes-communicated column shows the
   cost of giving up privacy; clients re-send their rows every round (the
   engine keeps no server memory of them; full participation makes this the
   plain pooled-data baseline);
2. the server pools the rows, sorts them canonically (lexicographically by
   inputs then target: the pool, and so the trained model, does not depend
   on the order in which clients reply) and trains the global model for
   ``local_epochs`` epochs of minibatch SGD over the pool with the shared
   recipe (lr, batch size, momentum, weight decay) — the order of the pool's
   rows is a seeded shuffle whose seed is derived from the sorted seeds of
   the clients that replied (so it depends on the run seed and the round,
   never on a global RNG);
3. every client uses the global model.

``centralized_ft`` adds per-sensor fine-tuning: the personal model is the
global model after ``finetune_epochs`` epochs of local SGD on the client's own
rows (default 5 — ours: one round's worth of local epochs, the same budget
``fedavg_ft`` gets).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree, expand, tree_map


def canonical_order(rows: Tensor) -> Tensor:
    """Indices sorting ``rows`` (N, D) lexicographically (column 0 first).

    Stable sorts from the last key to the first, so ties on a column keep the
    order of the later columns.
    """
    order = torch.arange(rows.shape[0])
    for col in reversed(range(rows.shape[1])):
        order = order[torch.sort(rows[order, col], stable=True).indices]
    return order


def pool_seed(client_seeds: Tensor) -> int:
    """A seed for the server's shuffle from the repliers' seeds, independent of their order."""
    ordered = sorted(int(s) for s in client_seeds.tolist())
    state = np.random.SeedSequence(ordered).generate_state(1, dtype=np.uint64)[0]
    return int(state >> np.uint64(1))


def pool(replies: Tree) -> ClientData:
    """The clients' uploaded rows as one canonically sorted cohort of one."""
    x, y, count = replies["x"], replies["y"], replies["count"]
    real = torch.arange(x.shape[1]).unsqueeze(0) < count.unsqueeze(1)  # (clients, rows)
    px, py = x[real], y[real]  # (N, F), (N, T)
    order = canonical_order(torch.cat([px, py], dim=1))
    return ClientData(
        px[order].unsqueeze(0),
        py[order].unsqueeze(0),
        torch.tensor([px.shape[0]]),
        (pool_seed(replies["seed"]),),
    )


@dataclass(frozen=True)
class Centralized(Algorithm):
    name = "centralized"
    uploads = ("raw_rows",)

    reply_aggregation = "custom"  # replies are pooled data

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        reply = {
            "x": data.x,
            "y": data.y,
            "count": data.count,
            "seed": torch.tensor(data.seeds, dtype=torch.int64),
        }
        return ClientResult(reply, state, {"train_loss": self.local_loss(down["model"], data)})

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        # Every pooled row counts once: ``weights`` (and sample_weighted) play no role.
        trained, _ = self.local_train(expand(server["model"], 1), pool(replies))
        return {**server, "model": tree_map(lambda t: t[0], trained)}


@dataclass(frozen=True)
class CentralizedFinetune(Centralized):
    finetune_epochs: Annotated[int, Field(ge=0)] = 5

    name = "centralized_ft"

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        return self.local_train(down["model"], data, epochs=self.finetune_epochs)[0]
