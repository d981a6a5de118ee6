"""The engine's round loop at its plainest, for tests and benchmarks of one algorithm's math.

Every client takes part in every round and every reply is accepted (no
screening, no chunks): what :func:`fedcal.engine.simulation.simulate` does
with a full cohort and the PLAIN policy, without its bookkeeping.
"""

from __future__ import annotations

from typing import NamedTuple

from fedcal.core.algorithm import Algorithm
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree, expand


class Rounds(NamedTuple):
    server: Tree
    states: Tree
    personal: Tree
    metrics: list[dict]  # each round's client metrics, in order


def run_rounds(alg: Algorithm, data: ClientData, rounds: int) -> Rounds:
    """``rounds`` rounds of every client of ``data``; the personalized models after the last."""
    n = data.num_clients
    server = alg.server_init({})
    states = alg.client_init(expand(alg.broadcast(server), n))
    metrics = []
    for _ in range(rounds):
        result = alg.client_update(expand(alg.broadcast(server), n), states, data)
        states = result.state
        server = alg.server_update(server, result.reply, data.count)
        metrics.append(result.metrics)
    personal = alg.personalize(expand(alg.broadcast(server), n), states, data)
    return Rounds(server, states, personal, metrics)
