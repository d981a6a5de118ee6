"""Screening a fleet prior's uploads when the units' data are unequal (issue 26 item 4).

A planted field-like fleet of 8 units under one linear-in-x quadratic calibration: unit 0
has 100× the rows of the others, unit 1 a time span 50× theirs, unit 2 pollution
episodes (a few inputs 12 × the usual spread, as real PM2.5 sensors see). All are honest:
no unit may be screened out in any round. A unit that multiplies its statistics by 1000
must be rejected, by size, in every round. Before the fix the design Gram ΦᵀΦ — a sum of
x⁴ for a quadratic basis, so the episodes make it ~10³ × the others' per row — was judged
by size and unit 2 was rejected in every round.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcal.algorithms.fedprior_drift import FedPriorDrift
from fedcal.core.aggregation import AggregationPolicy, aggregate
from fedcal.core.bayes import F64
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.core.tree import expand, flatten, unflatten
from fedcal.models.mlp import MLP

UNITS, ROWS, ROUNDS = 8, 30, 4
DAY = 86400.0


def _fleet() -> ClientData:
    rng = np.random.default_rng(0)
    data, times = [], []
    for i in range(UNITS):
        n = ROWS * (100 if i == 0 else 1)
        x = rng.uniform(-1.0, 1.0, n)
        if i == 2:  # episodes: 3 rows far out (honest high readings)
            x[:3] = 12.0 * rng.uniform(0.8, 1.0, 3)
        gain, offset = 1.0 + 0.1 * rng.standard_normal(), 0.1 * rng.standard_normal()
        y = offset + gain * x + 0.05 * x**2 + 0.05 * rng.standard_normal(n)
        span = (50.0 if i == 1 else 1.0) * 30 * DAY
        t = 1.7e9 + np.sort(rng.uniform(0.0, span, n))
        data.append((x[:, None], y[:, None]))
        times.append(t)
    return ClientData.from_arrays(data, tuple(range(UNITS)), F64, time=times)


def _times1000(reply, client: int):
    # every statistic but the row count (a count check alone would catch that)
    flat = {}
    for key, leaf in flatten(reply).items():
        if leaf.is_floating_point() and key != "n":
            leaf = leaf.clone()
            leaf[client] = leaf[client] * 1000.0
        flat[key] = leaf
    return unflatten(flat)


def _rounds(alg, data, attacker: int | None) -> list[dict]:
    """ROUNDS rounds through the server's default screening; every rejection recorded."""
    policy = AggregationPolicy()  # the default: size screen at 10×, consistency check
    server = alg.server_init({})
    states = alg.client_init(expand(alg.broadcast(server), UNITS))
    record: list[dict] = []
    for rnd in range(ROUNDS):
        down = alg.broadcast(server)
        result = alg.client_update(expand(down, UNITS), states, data)
        reply = result.reply if attacker is None else _times1000(result.reply, attacker)
        before = len(record)
        server, _, _ = aggregate(
            alg, server, down, reply, data.count.to(F64), policy, rnd, record=record
        )
        for r in record[before:]:
            r["round"] = rnd
        states = result.state
    return record


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    alg = FedPriorDrift(Task(MLP(in_features=1)), basis="total", degree=2)
    return alg, _fleet()


def test_honest_unequal_units_are_never_screened_out(setup):
    alg, data = setup
    assert int(data.count[0]) == 100 * int(data.count[3])  # the planted inequality
    assert _rounds(alg, data, None) == []


@pytest.mark.parametrize("attacker", [0, 2, 5])  # the data-rich unit, the episodes, a plain one
def test_a_x1000_unit_is_rejected_in_every_round_and_no_honest_one(setup, attacker):
    alg, data = setup
    record = _rounds(alg, data, attacker)
    assert {r["client"] for r in record} == {attacker}
    assert sorted({r["round"] for r in record}) == list(range(ROUNDS))
    sizes = [r for r in record if r["reason"] == "size"]
    assert len(sizes) == ROUNDS and min(r["ratio"] for r in sizes) > 100.0


def test_a_gram_alone_x1000_is_still_rejected_by_the_consistency_check(setup):
    """The Gram is no longer judged by size: a unit inflating only it is caught by G_00 = n."""
    alg, data = setup
    server = alg.server_init({})
    down = alg.broadcast(server)
    result = alg.client_update(expand(down, UNITS), alg.client_init(expand(down, UNITS)), data)
    reply = {**result.reply, "gram": result.reply["gram"].clone()}
    reply["gram"][4] *= 1000.0
    record: list[dict] = []
    policy = AggregationPolicy()
    aggregate(alg, server, down, reply, data.count.to(F64), policy, 0, record=record)
    assert [r["client"] for r in record] == [4]
    assert record[0]["reason"].startswith("Gram's constant term")
