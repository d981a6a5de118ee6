"""A streamed round's chunks computed on worker threads (``[engine] workers``, issue 36.1).

The round's numbers must not depend on the workers or on torch's thread count: each chunk
is computed alone with torch on one thread and taken in chunk order. Checked to the bit on
test_streamed's hostile fleet (a 10³× unit screened by size, a negative RSS rejected, a NaN
reply, an offset unit down-weighted by the robust M-step), with the candidate bases on a
sample of the units (two groups of chunks), chunks of 3 units.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from fedcal.core.aggregation import AggregationPolicy
from fedcal.core.algorithm import ClientResult
from fedcal.core.bayes import F64
from fedcal.core.tree import expand, flatten
from fedcal.engine import chunks, streamed
from fedcal.engine.settings import AUTO_WORKERS_MAX, available_cores, resolve_workers
from fedcal.engine.simulation import EngineConfig, prepare, simulate

from .test_streamed import UNITS, Hostile, fleet, make


def _round(alg, server, states, data, workers: int, threads: int):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        record: list[dict] = []
        upload: list[int] = []
        down = alg.broadcast(server)
        out = streamed.streamed_round(
            alg,
            server,
            down,
            states,
            data,
            data.count.to(F64),
            AggregationPolicy(),
            3,
            record,
            upload,
            workers,
        )
        assert torch.get_num_threads() == threads  # torch's threads given back
        return out, record, upload
    finally:
        torch.set_num_threads(before)


def test_any_number_of_workers_gives_the_same_bits():
    alg, data = make(robust="full", select="bic", select_units=8), fleet()
    server = alg.server_init(alg.task.model.init(torch.Generator().manual_seed(0), F64))
    states = alg.client_init(expand(alg.broadcast(server), UNITS))
    for t in range(2):
        server = alg.before_round(server, t, 5, UNITS)
        runs = [_round(alg, server, states, data, w, th) for w, th in ((1, 1), (3, 1), (2, 2))]
        (one, record, upload), *others = runs
        result, new_server, accepted, metrics = one
        assert int((~accepted).sum()) == 3  # the round's rejections happened in every run
        assert any(r["reason"].startswith("prior outlier") for r in record)
        for (res, srv, acc, met), rec, up in others:
            assert torch.equal(acc, accepted) and met == metrics
            assert repr(rec) == repr(record) and up == upload  # (repr: NaN ratios equal)
            for key, v in flatten(new_server).items():
                assert torch.equal(flatten(srv)[key], v), key
            for key, v in flatten(result.state).items():
                assert torch.equal(flatten(res.state)[key], v), key
            for key, v in flatten(result.metrics).items():
                assert torch.equal(
                    flatten(res.metrics)[key],
                    v,
                ), key
        server, states = new_server, result.state


@dataclasses.dataclass(frozen=True)
class Failing(Hostile):
    """fedprior whose unit of 12 rows (in the fourth chunk of 3) cannot compute its update."""

    def client_update(self, down, state, data) -> ClientResult:
        if bool((data.count == 12).any()):
            raise ArithmeticError("unit of 12 rows: no update")
        return super().client_update(down, state, data)


def test_a_chunk_that_fails_fails_the_round_and_gives_torch_its_threads_back():
    alg, data = (
        Failing(**{f.name: getattr(make(), f.name) for f in dataclasses.fields(Hostile)}),
        fleet(),
    )
    server = alg.server_init(alg.task.model.init(torch.Generator().manual_seed(0), F64))
    states = alg.client_init(expand(alg.broadcast(server), UNITS))
    threads = torch.get_num_threads()
    with pytest.raises(ArithmeticError, match="12 rows"):
        _round(alg, server, states, data, 2, threads)
    assert torch.get_num_threads() == threads


def test_in_order_yields_every_chunk_in_order_with_few_in_flight():
    started: list[int] = []

    def measured(rows):
        started.append(int(rows[0]))
        return int(rows[0]), int(rows[-1])

    spans = list(chunks.spans(10, 3))
    assert list(chunks.in_order(measured, iter(spans), 1)) == [(0, 2), (3, 5), (6, 8), (9, 9)]
    started.clear()
    seen = []
    for got in chunks.in_order(measured, iter(spans), 2):
        seen.append(got)
        # at most workers + 1 = 3 chunks submitted beyond the ones taken
        assert len(started) <= len(seen) + 2
    assert seen == [(0, 2), (3, 5), (6, 8), (9, 9)]


def test_workers_setting():
    assert EngineConfig().workers == "auto"
    assert resolve_workers("auto", 2) == 2 and resolve_workers(3, 2) == 3
    assert resolve_workers("auto", 0) == 1
    assert resolve_workers("auto", 64) == AUTO_WORKERS_MAX < 64  # chunks in flight bounded
    assert resolve_workers(64, 2) == 64  # a number given is kept
    assert 1 <= available_cores() <= (os.cpu_count() or 1)
    for bad in (0, -1, 2.5, True, "many"):
        with pytest.raises(ValueError, match="workers"):
            EngineConfig(workers=bad)


def test_the_engine_passes_its_workers(make_fleet, monkeypatch):
    """``[engine] workers`` reaches the streamed round ("auto": the cores this process may
    use, whatever torch's thread count: `fedcal run` sets that to one), and two runs with 1
    and 3 workers give the same numbers."""
    tensors = prepare(make_fleet(num_clients=12), dtype="float64")
    alg = make(robust="full")
    seen = []
    real = streamed.streamed_round
    monkeypatch.setattr(streamed, "streamed_round", lambda *a: seen.append(a[-1]) or real(*a))
    monkeypatch.setattr(streamed, "STREAM_ABOVE", 0)
    runs = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as `fedcal run` does
    try:
        for workers in (1, 3, "auto"):
            config = EngineConfig(rounds=2, seed=0, dtype="float64", chunk_size=5, workers=workers)
            runs[workers] = simulate(alg, tensors, config)
    finally:
        torch.set_num_threads(threads)
    cores = min(available_cores(), AUTO_WORKERS_MAX)
    assert seen == [1, 1, 3, 3, cores, cores]
    for key, v in flatten(runs[1].server).items():
        assert torch.equal(flatten(runs[3].server)[key], v), key
    assert [r["test_rmse"] for r in runs[3].final] == [r["test_rmse"] for r in runs[1].final]
