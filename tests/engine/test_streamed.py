"""A streamed "sum" round (engine/streamed.py) against the assembled one (core/aggregation.py).

A 20-unit planted fleet with a unit whose targets are 10³× the others' (size-screened: its
reply is summed, then recomputed and subtracted), one whose upload has a negative RSS
(rejected by the consistency check, never summed), one whose upload is NaN, and one whose
targets are offset by 1 (with robust = "full", down-weighted by the M-step: its reply
recomputed and added with weight w_i − 1); robust "check" and "full", and "full" with
select = "bic". The streamed round, 6 units a chunk, must take the same decisions, record
the same reasons and give the same server within 1e-10 of each leaf's scale (chunk-order
sums).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fedcal.algorithms.fedprior import FedPrior
from fedcal.core.aggregation import AggregationPolicy, aggregate, finite_rows
from fedcal.core.algorithm import ClientResult
from fedcal.core.bayes import F64
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.core.tree import expand, flatten, gather, num_bytes
from fedcal.engine import chunks, streamed
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal.models.mlp import MLP

UNITS, ROWS = 20, 10
LOUD, WRONG, NAN, FAR = 4, 11, 17, 8  # the hostile units' positions
OFFSET = 1.0  # the far unit's targets moved: down-weighted by robust = "full", not screened


@dataclasses.dataclass(frozen=True)
class Hostile(FedPrior):
    """fedprior whose unit with 11 rows uploads a negative RSS and with 12 rows a NaN mean
    (keyed on the data, so chunks and recomputations see the same unit)."""

    def client_update(self, down, state, data) -> ClientResult:
        out = super().client_update(down, state, data)
        reply = dict(out.reply)
        reply["rss"] = torch.where(data.count == ROWS + 1, -1e-9, reply["rss"])
        nan = (data.count == ROWS + 2).to(F64).unsqueeze(-1)
        reply["mean"] = torch.where(nan > 0, torch.nan, reply["mean"])
        return ClientResult(reply, out.state, out.metrics)


def fleet(rows: dict[int, int] | None = None) -> ClientData:
    gen = torch.Generator().manual_seed(0)
    arrays = []
    for i in range(UNITS):
        n = ROWS + (i == WRONG) + 2 * (i == NAN)
        n = (rows or {}).get(i, n)
        x = 2 * torch.rand(n, 2, generator=gen, dtype=F64) - 1
        coef = torch.tensor([0.5, 0.2, -0.3, 0.1], dtype=F64) + 0.1 * torch.randn(
            4, generator=gen, dtype=F64
        )
        y = coef[0] + coef[1] * x[:, 0] + coef[2] * x[:, 1] + coef[3] * x[:, 0] * x[:, 1]
        y = y + 0.01 * torch.randn(n, generator=gen, dtype=F64)
        y = y * (1e3 if i == LOUD else 1.0) + (OFFSET if i == FAR else 0.0)
        arrays.append((x.numpy(), y.unsqueeze(-1).numpy()))
    return ClientData.from_arrays(arrays, tuple(range(UNITS)), F64)


def make(**kw) -> Hostile:
    params = {"orders": (1, 1), "robust": "check", "interval": "posterior", **kw}
    return Hostile(Task(MLP()), **params)


@pytest.mark.parametrize(
    ("robust", "select"), [("check", "none"), ("full", "none"), ("full", "bic")]
)
def test_streamed_round_equals_the_assembled_round(robust, select):
    alg, data = make(robust=robust, select=select), fleet()
    policy = AggregationPolicy()  # screen_factor 10, the default
    server = alg.server_init(alg.task.model.init(torch.Generator().manual_seed(0), F64))
    states = alg.client_init(expand(alg.broadcast(server), UNITS))
    weights = data.count.to(F64)
    for _ in range(2):  # the second round from the first's prior (a non-vague Σ)
        down = alg.broadcast(server)
        whole = chunks.client_update(alg, down, states, data)
        record: list[dict] = []
        ok = finite_rows(whole.state)  # as the engine passes it
        want, accepted, metrics = aggregate(
            alg, server, down, whole.reply, weights, policy, 0, eligible=ok, record=record
        )
        mine: list[dict] = []
        result, got, s_acc, s_metrics = streamed.streamed_round(
            alg, server, down, states, data, weights, policy, 6, mine
        )
        assert s_acc.tolist() == accepted.tolist()
        assert sorted(i for i in range(UNITS) if not accepted[i]) == [LOUD, WRONG, NAN]
        assert [(r["client"], r["reason"], r["threshold"]) for r in mine] == [
            (r["client"], r["reason"], r["threshold"]) for r in record
        ]
        assert [r["ratio"] for r in mine] == pytest.approx(
            [r["ratio"] for r in record], nan_ok=True
        )
        assert s_metrics == pytest.approx(metrics, nan_ok=True)
        assert s_metrics["rejected_inconsistent"] == 1 and s_metrics["rejected_norm"] == 1
        low = [r["client"] for r in mine if r["reason"].startswith("prior outlier")]
        assert low == ([FAR] if robust == "full" else [])  # down-weighted, still used
        for key, v in flatten(want).items():
            # within 1e-10 of the leaf's scale: the subtracted 10³× unit's log-evidence
            # (a candidate's BIC score) leaves ~2e-9 on a score of −3.3 (a sum of ±250)
            scale = float(v.abs().max()) if v.is_floating_point() and v.numel() else 0.0
            torch.testing.assert_close(
                flatten(got)[key], v, rtol=1e-10, atol=max(1e-12, 1e-10 * scale), msg=key
            )
        for key, v in flatten(whole.state).items():  # states assembled to the bit
            assert torch.equal(flatten(result.state)[key], v)
        server, states = want, whole.state


TIED = (7, 15)  # units of 5 rows: the smallest design among the used units, a tie


def test_the_calibrated_intervals_probe_streams():
    """interval = "calibrated" with own_folds = 5: the probe is an arg-min over the used units
    (the screened 10³× unit has the smallest design, 4 rows, and must not be it; two units of
    5 rows, neither in the first chunk, tie: the canonical order of m_i decides), the hold-out
    counts and τ², τ²_own are sums; streamed = assembled over 3 rounds (the probe chosen in
    round 1 is held out against in round 2, τ² used in round 3)."""
    alg = make(robust="full", interval="calibrated", own_folds=5, probe_rows=6)
    data = fleet({LOUD: 4, TIED[0]: 5, TIED[1]: 5})
    policy = AggregationPolicy()
    server = alg.server_init(alg.task.model.init(torch.Generator().manual_seed(0), F64))
    states = alg.client_init(expand(alg.broadcast(server), UNITS))
    weights = data.count.to(F64)
    for rnd in range(3):
        down = alg.broadcast(server)
        whole = chunks.client_update(alg, down, states, data)
        record: list[dict] = []
        want, accepted, metrics = aggregate(
            alg,
            server,
            down,
            whole.reply,
            weights,
            policy,
            0,
            eligible=finite_rows(whole.state),
            record=record,
        )
        mine: list[dict] = []
        _, got, s_acc, s_metrics = streamed.streamed_round(
            alg, server, down, states, data, weights, policy, 6, mine
        )
        assert s_acc.tolist() == accepted.tolist()
        assert sorted(i for i in range(UNITS) if not accepted[i]) == [LOUD, WRONG, NAN]
        assert [(r["client"], r["reason"]) for r in mine] == [
            (r["client"], r["reason"]) for r in record
        ]
        # the recomputed, re-weighted replies (step 4); in round 0 the prior is the vague
        # start, and a 10-row unit's offset is within its own uncertainty (issue 34.3)
        assert metrics["downweighted"] >= (1 if rnd else 0)
        assert s_metrics == pytest.approx(metrics, nan_ok=True)
        # the probe: 5 rows (not the screened unit's 4), the tied unit first in m_i order
        x = flatten(whole.reply)
        means = x["mean"][list(TIED)]
        first = TIED[int(np.lexsort(means.numpy().T[::-1])[0])]
        assert first == TIED[1]  # the later unit: the tie is not broken by client order
        assert float(got["probe_n"]) == 5.0
        assert torch.equal(got["probe_x"][:5], x["interval/x"][first][:5])
        assert not torch.equal(x["interval/x"][TIED[0]], x["interval/x"][TIED[1]])
        if rnd:
            assert float(got["disc_own"]) > 0 and float(want["disc_var"]) >= 0
        for key, v in flatten(want).items():
            scale = float(v.abs().max()) if v.is_floating_point() and v.numel() else 0.0
            torch.testing.assert_close(
                flatten(got)[key], v, rtol=1e-10, atol=max(1e-12, 1e-10 * scale), msg=key
            )
        server, states = want, whole.state


def test_a_sampled_round_streams_its_sample_apart():
    """select = "bic" with its candidates on a sample (fedprior_rounds R1, select_units 8 of
    20): the streamed round runs the units outside the sample under the broadcast without
    the candidates (their replies hold no candidate leaf, not zeros), then the sample. Two
    rounds equal the assembled round (every unit's reply, zeros outside the sample) within
    1e-10 of each leaf's scale, the same decisions, the states to the bit; the upload is
    each unit's own reply: the sample's full size, the others' without the candidates."""
    alg, data = make(robust="full", select="bic", select_units=8), fleet()
    policy = AggregationPolicy()
    server = alg.server_init(alg.task.model.init(torch.Generator().manual_seed(0), F64))
    states = alg.client_init(expand(alg.broadcast(server), UNITS))
    weights = data.count.to(F64)
    for t in range(2):
        server = alg.before_round(server, t, 5, UNITS)  # the sample's rate: 8 / 20
        down = alg.broadcast(server)
        sampled = alg.sampled_clients(down, data)
        assert 0 < int(sampled.sum()) < UNITS  # both groups (the units' own draws)
        whole = chunks.client_update(alg, down, states, data)
        want, accepted, metrics = aggregate(
            alg, server, down, whole.reply, weights, policy, 0, eligible=finite_rows(whole.state)
        )
        upload: list[int] = []
        result, got, s_acc, s_metrics = streamed.streamed_round(
            alg, server, down, states, data, weights, policy, 6, None, upload
        )
        assert s_acc.tolist() == accepted.tolist()
        assert s_metrics == pytest.approx(metrics, nan_ok=True)
        for key, v in flatten(want).items():
            scale = float(v.abs().max()) if v.is_floating_point() and v.numel() else 0.0
            torch.testing.assert_close(
                flatten(got)[key], v, rtol=1e-10, atol=max(1e-12, 1e-10 * scale), msg=key
            )
        for key, v in flatten(whole.state).items():
            assert torch.equal(flatten(result.state)[key], v)
        one = torch.arange(1)
        lean = alg.client_update(
            expand(alg.unsampled_broadcast(down), 1), gather(states, one), data.select(one)
        ).reply
        assert "cand" not in lean and "cand" in whole.reply
        small, full = (
            num_bytes(lean, per_client_axis=True),
            streamed.reply_bytes(alg, down, states, data),
        )
        k = int(sampled.sum())
        assert upload == [k * full + (UNITS - k) * small]
        # what the others do not send: exactly the candidates' leaves
        cand = {key: v[:1] for key, v in flatten(whole.reply["cand"]).items()}
        assert full - small == num_bytes(cand, per_client_axis=True) > 0
        server, states = want, whole.state


def test_settings_that_need_each_units_reply_are_refused():
    plain = AggregationPolicy()
    assert streamed.eligible(make(), plain) is None
    assert streamed.eligible(make(robust="full"), plain) is None
    assert streamed.eligible(make(interval="calibrated", own_folds=5), plain) is None
    assert "krum" in streamed.eligible(make(), AggregationPolicy(rule="krum"))
    # the noise model's evidence is clipped per unit (a forged unit's pull bounded by its rows)
    assert "noise" in streamed.eligible(make(noise_tail="auto"), plain)
    assert "noise" in streamed.eligible(make(noise_shape="inputs"), plain)


@pytest.mark.parametrize(
    ("robust", "interval"), [("check", "posterior"), ("full", "posterior"), ("full", "calibrated")]
)
def test_the_engine_streams_above_its_bound(robust, interval, make_fleet, monkeypatch):
    """The engine's own round loop, streamed (bound 0) and assembled (the default bound, far
    above 12 units): the same rejections, per-unit rows (with the calibrated interval, its
    coverage and stated sd: units 7 and 10 of 8 rows are the probe's class) and server
    within rounding."""
    train = [8 if i in (7, 10) else 24 for i in range(12)]
    tensors = prepare(make_fleet(num_clients=12, train=train), dtype="float64")
    extra = {"own_folds": 5, "probe_rows": 10} if interval == "calibrated" else {}
    alg = make(robust=robust, interval=interval, **extra)
    config = EngineConfig(
        rounds=3, seed=0, dtype="float64", chunk_size=5, aggregation=AggregationPolicy()
    )
    calls = []
    real = streamed.streamed_round
    monkeypatch.setattr(streamed, "streamed_round", lambda *a: calls.append(1) or real(*a))
    assembled = simulate(alg, tensors, config)
    assert calls == []  # 12 units' replies are far below the default bound: assembled
    monkeypatch.setattr(streamed, "STREAM_ABOVE", 0)
    streamed_run = simulate(alg, tensors, config)
    assert len(calls) == 3  # every round streamed
    assert streamed_run.extra["rejections"] == assembled.extra["rejections"]
    assert streamed_run.bytes_up_per_round == assembled.bytes_up_per_round
    for key, v in flatten(assembled.server).items():
        torch.testing.assert_close(
            flatten(streamed_run.server)[key], v, rtol=1e-10, atol=1e-12, msg=key
        )
    for a, b in zip(assembled.final, streamed_run.final, strict=True):
        assert a["client_index"] == b["client_index"]
        assert b["test_rmse"] == pytest.approx(a["test_rmse"], rel=1e-9)
        for key in ("test_coverage95", "test_pred_sd", "status"):
            want = a[key] if key == "status" else pytest.approx(a[key], rel=1e-9, nan_ok=True)
            assert b[key] == want, key
    if interval == "calibrated":  # a probe was chosen and units stated intervals
        assert float(streamed_run.server["probe_n"]) == 8.0
        assert any(a["test_coverage95"] >= 0 for a in assembled.final)


def test_a_subclass_with_its_own_server_update_is_refused():
    from fedcal.algorithms.fedprior_drift import FedPriorDrift

    drift = FedPriorDrift(Task(MLP()), orders=(1, 1), robust="check", interval="posterior")
    assert "its own" in streamed.eligible(drift, AggregationPolicy())
