"""Asynchronous FL with staleness-weighted mixing, in simulated time (seed 004's baseline).

The seed's "AsyncFL" baseline (its ref. [34], Xu et al., a survey) is not
specified further; we use the classic FedAsync rule (Xie, Koyejo & Gupta,
"Asynchronous Federated Optimization", 2019): when an update w_i arrives the
server mixes it in at once,
    w ← (1 − α_i)·w + α_i·w_i,   α_i = α·s(staleness_i),   s(k) = (1 + k)^(−a),
staleness_i being the number of updates the server applied since participant i
downloaded its model.

Simulated time (our simplification of an event-driven server): in each engine
round every participant downloads the current model at the same instant and
runs τ local steps (fixed, ``initial_tau`` = 10 as the seed's FedAvg baseline);
its update arrives after c_i·Q_i time units (per-sample time c_i of AFL-CSEM's
cost model × samples trained), so faster participants arrive first. The server
applies the round's updates in order of arrival (ties broken by a client key
carried in the reply — the client's round seed — so the result does not depend
on the order replies are stacked in): the k-th arrival has staleness k. A
participant contributes one update per round, i.e. a slow participant does not
fall further behind across rounds — real asynchrony would let fast
participants send several updates while a slow one trains once. Every mixing
is one server aggregation for the budget (cost b each); local work is charged
as in AFL-CSEM (9)–(11), and the budget stop and best-model rule (8) are
AFL-CSEM's. ``server["clock"]`` accumulates the simulated time: per round the
last arrival, plus c per mixing.

Defaults: α = 0.6 and a = 0.5 (the polynomial staleness function of FedAsync's
experiments), τ = 10 (the seed's fixed-τ baseline).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch
from pydantic import Field
from torch import Tensor

from fedcal.algorithms.aflcsem import AFLCSEM, STOPPED
from fedcal.core.algorithm import ClientResult
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree, tree_map


def arrival_order(finish: Tensor, keys: Tensor) -> Tensor:
    """Indices sorted by finish time, ties by key (a total order independent of stacking)."""
    by_key = torch.argsort(keys, stable=True)
    by_time = torch.argsort(finish[by_key], stable=True)
    return by_key[by_time]


def staleness_weights(count: int, alpha: float, exponent: float) -> Tensor:
    """α·(1 + k)^(−a) for the k-th arrival, k = 0..count−1."""
    k = torch.arange(count, dtype=torch.float64)
    return alpha * (1.0 + k).pow(-exponent)


@dataclass(frozen=True)
class AsyncFL(AFLCSEM):
    initial_tau: Annotated[int, Field(ge=1)] = 10
    mixing: Annotated[float, Field(gt=0.0, le=1.0)] = 0.6  # α
    staleness_exponent: Annotated[float, Field(ge=0.0)] = 0.5  # a

    name = "asyncfl"

    def server_init(self, params: Tree) -> Tree:
        return {**super().server_init(params), "clock": torch.zeros((), dtype=torch.float64)}

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        result = super().client_update(down, state, data)
        key = torch.tensor(data.seeds, dtype=torch.int64)
        return ClientResult({**result.reply, "key": key}, result.state, result.metrics)

    def next_tau(self, server: Tree, estimates: Tree, step_cost: float) -> int:
        return self.initial_tau

    def aggregate(self, server: Tree, replies: Tree) -> tuple[Tree, int]:
        """Mix the updates in order of simulated arrival, each weighted by its staleness."""
        finish = replies["time_per_sample"] * replies["samples"]
        order = arrival_order(finish, replies["key"]).tolist()
        alphas = staleness_weights(len(order), self.mixing, self.staleness_exponent)
        model = server["model"]
        for k, i in enumerate(order):
            a = float(alphas[k])
            model = tree_map(
                lambda w, u, i=i, a=a: (1.0 - a) * w + a * u[i], model, replies["model"]
            )
        return model, len(order)

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        new = super().server_update(server, replies, weights)
        if int(server["stage"]) == STOPPED or int(server["tau"]) == 0:
            return new
        last_arrival = (replies["time_per_sample"] * replies["samples"]).max()
        mixes = replies["samples"].shape[0]
        clock = server["clock"] + last_arrival + mixes * self.aggregation_time
        return {**new, "clock": clock}
