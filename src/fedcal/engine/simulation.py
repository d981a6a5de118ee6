"""The vectorized simulator: the whole cohort of a round trained at once.

Private client state lives in one client tree for the whole fleet,
``(num_clients, ...)``; each round the cohort's rows are gathered, the
algorithm's client step runs once over the cohort, and the new rows are
scattered back. The same client gets the same seeds whatever the cohort, so
running the fleet at once equals running each client alone (tested).

A run can checkpoint every few rounds and resume from the checkpoint with the
same numbers as an uninterrupted run: all randomness is a function of (seed,
round, client), and the checkpoint holds the complete state.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from pydantic import InstanceOf
from torch import Tensor

from fedcal.core.aggregation import PLAIN, AggregationPolicy, aggregate, finite_rows
from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.data import HOST, ClientData, client_round_seed
from fedcal.core.hooks import DerivesData, EndsRounds
from fedcal.core.schema import Seed, checked
from fedcal.core.tree import Tree, expand, gather, num_bytes, per_client, scatter, tree_map
from fedcal.engine import chunks, streamed

# re-exported: callers import the tensors and the checkpoint's error from here too
from fedcal.engine.checkpoint import CheckpointError as CheckpointError
from fedcal.engine.checkpoint import _fingerprint, load_checkpoint, save_checkpoint
from fedcal.engine.evaluation_fleet import evaluate_fleet as _evaluate
from fedcal.engine.evaluation_fleet import seeds_for as _seeds
from fedcal.engine.evaluation_fleet import unit_columns
from fedcal.engine.history import (
    Block,
    History,
    block_rows,
    round_block,
)
from fedcal.engine.memory import keep_freed_memory
from fedcal.engine.schedule import (
    cohort,
    evaluates,
    train_seeds,
)
from fedcal.engine.settings import (
    EngineSettings,
    available_cores,
    mostly_refused,
    refused_clients,
    resolve_eval_every,
    resolve_workers,
    unjudged,
)
from fedcal.engine.tensors import DTYPES, FleetTensors
from fedcal.engine.tensors import prepare as prepare
from fedcal.engine.tensors import prepare_chunks as prepare_chunks

AGGREGATION = 3  # seed purpose of the server's DP noise (clients use 0.., see core.data)


@checked
class EngineConfig(EngineSettings):
    """A simulator run's settings: :class:`EngineSettings` plus its seeds and server policy."""

    seed: Seed = 0
    init_seed: Seed | None = None  # model init seed; defaults to ``seed``
    # Server-side screening/clipping/robust rule/DP (fedcal.core.aggregation). PLAIN only
    # rejects non-finite replies; the experiment passes the configuration's policy.
    aggregation: InstanceOf[AggregationPolicy] = PLAIN


@dataclass
class RunResult:
    """Everything a run produced; ``history`` rows are per round and client (a
    :class:`~fedcal.engine.history.History`: columns, read as rows)."""

    history: History | list[dict]
    final: list[dict]
    personal: Tree
    server: Tree
    states: Tree
    wall_s: float
    bytes_up_per_round: float
    bytes_down_per_round: float
    rounds_done: int = 0
    extra: dict = field(default_factory=dict)


@dataclass
class _Run:
    """A run between rounds: its state (what a checkpoint holds) and what it measured."""

    server: Tree
    states: Tree
    history: History
    start_round: int
    elapsed: float
    rejected: Tensor  # rounds each client's reply was rejected
    rounds_log: list[dict]
    rejections: list[dict]  # every rejection: round, client, reason, ratio, threshold
    fingerprint: str
    bytes_up: list[int] = field(default_factory=list)
    bytes_down: list[int] = field(default_factory=list)
    reply_size: list[int] = field(default_factory=list)  # one client's reply bytes (_streams)
    personal: Tree | None = None  # after the last round: every client's personal model
    last_rows: Block | None = None  # after the last round: the evaluation's columns
    summary: dict = field(default_factory=dict)  # the latest evaluation's fleet summary
    units: tuple = ()  # the fleet's unit indices and names (unit_columns), once a run
    unscored: _Round | None = None  # the last round, when not evaluated (scored late)


@dataclass(frozen=True)
class _Round:
    """A trained round as its evaluation reads it: the server and states after round ``t``
    (0-based), the rejection counts then, and the round's client metrics of the cohort
    ``ids``."""

    t: int
    server: Tree
    states: Tree
    rejected: Tensor
    metrics: dict[str, Tensor]
    ids: list[int]


def simulate(
    algorithm: Algorithm,
    fleet: FleetTensors,
    config: EngineConfig = EngineConfig(),
    on_round: Callable[[int, dict], None] | None = None,
    checkpoint: Path | None = None,
    checkpoint_every: int = 10,
) -> RunResult:
    """Run ``config.rounds`` rounds of ``algorithm`` on ``fleet`` (one if it is one-shot).

    With ``checkpoint`` the state is saved there every ``checkpoint_every``
    rounds, and an existing checkpoint of the same algorithm, data and config
    is resumed from.
    """
    keep_freed_memory()
    # eval_every "auto": from the fleet's size (engine.settings.resolve_eval_every)
    every = resolve_eval_every(config.eval_every, fleet.num_clients)
    if every != config.eval_every:
        config = dataclasses.replace(config, eval_every=every)
    # A closed-form method (Algorithm.one_shot) is done after one round: later rounds
    # would repeat it exactly, so they are not run.
    rounds = 1 if algorithm.one_shot else config.rounds
    device = chunks.resolve_device(config.device)
    run = _start(algorithm, fleet, config, checkpoint)
    run.units = unit_columns(fleet)
    fleet = with_derived(algorithm, fleet, config.chunk_size, device)
    counts = fleet.train.count.to(torch.float64)
    t0 = time.perf_counter() - run.elapsed
    # An algorithm that schedules its rounds (EndsRounds: fedprior's, issue 36.1) sees each
    # round's index, the cap and the fleet's size first, and stops the run when finished.
    ends = isinstance(algorithm, EndsRounds)
    if ends and algorithm.finished(run.server):  # resumed after its finished round
        rounds = run.start_round
    for t in range(run.start_round, rounds):
        if ends:  # (fedprior: the last round holds out; its sample from the fleet's size)
            run.server = algorithm.before_round(run.server, t, rounds, fleet.num_clients)
        ids, result = _train_round(run, algorithm, fleet, counts, config, t, device)
        last = t == rounds - 1 or (ends and algorithm.finished(run.server))
        done = _Round(t, run.server, run.states, run.rejected, result.metrics, ids)
        if _score(run, algorithm, fleet, config, device, rounds, last, done) and on_round:
            on_round(t + 1, run.summary)
        if checkpoint is not None and (last or (t + 1) % checkpoint_every == 0):
            _save(run, Path(checkpoint), t, time.perf_counter() - t0)
        if last:
            rounds = t + 1  # the rounds done (fewer than the cap when the algorithm finished)
            break
    wall = time.perf_counter() - t0
    if run.start_round >= rounds:  # resumed after the last round: evaluate it here
        args = (algorithm, fleet, run.server, run.states, config, rounds - 1, device, True)
        run.last_rows, _, run.personal = _evaluate(*args, units=run.units)
    # the final table: the last evaluation's rows and the rounds each reply was rejected
    final = block_rows({**run.last_rows, "rejected_rounds": run.rejected.numpy()})
    return RunResult(
        history=run.history,
        final=final,
        personal=run.personal,
        server=run.server,
        states=run.states,
        wall_s=wall,
        bytes_up_per_round=float(np.mean(run.bytes_up)) if run.bytes_up else 0.0,
        bytes_down_per_round=float(np.mean(run.bytes_down)) if run.bytes_down else 0.0,
        rounds_done=rounds,
        # bytes_up: each round's upload of the whole cohort (a reply that shrinks in time,
        # fedprior's once its basis is chosen, issue 36.1)
        extra={
            "aggregation": run.rounds_log,
            "rejections": run.rejections,
            "bytes_up": run.bytes_up,
        },
    )


def _score(
    run: _Run,
    algorithm: Algorithm,
    fleet: FleetTensors,
    config: EngineConfig,
    device: torch.device,
    rounds: int,
    last: bool,
    done: _Round,
) -> bool:
    """Round ``done.t`` evaluated when the schedule says so (and always the last); whether
    it was. Before the last, the round before it when that one was kept unscored."""
    if last or evaluates(done.t, rounds, config.eval_every):
        if last and run.unscored is not None:  # the round before the last, scored late
            _evaluate_round(run, algorithm, fleet, config, device, False, run.unscored)
        _evaluate_round(run, algorithm, fleet, config, device, last, done)
        run.unscored = None
        return True
    if isinstance(algorithm, EndsRounds):
        # Its next round may end the run (finished), unscheduled: the "unconverged"
        # judgement reads the last two evaluated rounds, so this one is kept (the
        # references alone: the next round makes new states) to be scored then too.
        run.unscored = done
    return False


def _save(run: _Run, path: Path, t: int, elapsed: float) -> None:
    """The run's checkpoint after round ``t`` (with an unscored round's client metrics)."""
    unscored = run.unscored
    save_checkpoint(
        path,
        run.fingerprint,
        t + 1,
        elapsed,
        run.server,
        run.states,
        run.history,
        run.rejected,
        run.rounds_log,
        run.rejections,
        None if unscored is None else (unscored.metrics, unscored.ids),
    )


def _start(
    algorithm: Algorithm, fleet: FleetTensors, config: EngineConfig, checkpoint: Path | None
) -> _Run:
    """The run's initial state, or its checkpoint's when there is one of this very run."""
    n = fleet.num_clients
    init_gen = torch.Generator().manual_seed(
        config.seed if config.init_seed is None else config.init_seed
    )
    server = algorithm.server_init(algorithm.task.model.init(init_gen, DTYPES[config.dtype]))
    states = tree_map(
        lambda t: t.contiguous().clone(),
        algorithm.client_init(expand(algorithm.broadcast(server), n)),
    )
    fingerprint = _fingerprint(algorithm, fleet, config)
    if checkpoint is not None and Path(checkpoint).exists():
        *saved, unscored = load_checkpoint(Path(checkpoint), fingerprint)
        run = _Run(*saved, fingerprint=fingerprint)
        if unscored is not None:  # its last round was not evaluated: scored late if need be
            t = run.start_round - 1
            run.unscored = _Round(t, run.server, run.states, run.rejected, *unscored)
        return run
    rejected = torch.zeros(n, dtype=torch.int64)
    return _Run(server, states, History(), 0, 0.0, rejected, [], [], fingerprint)


def _train_round(
    run: _Run,
    algorithm: Algorithm,
    fleet: FleetTensors,
    counts: Tensor,
    config: EngineConfig,
    t: int,
    device: torch.device,
) -> tuple[list[int], ClientResult]:
    """Round ``t``: the cohort's client step and the server's aggregation; the new states
    (a rejected client's rolled back), the rejections and the round's log into ``run``."""
    n = fleet.num_clients
    idx = cohort(config.seed, t, n, config.participation)
    ids = idx.tolist()
    # The whole fleet in order (cohort() sorts): no gathered copy of every client's
    # state or data.
    everyone = len(ids) == n
    data = (fleet.train if everyone else fleet.train.select(idx)).with_seeds(
        _seeds(algorithm, train_seeds, config.seed, t, ids)
    )
    down = algorithm.broadcast(run.server)
    before = run.states if everyone else gather(run.states, idx)
    record: list[dict] = []
    weights = counts.index_select(0, idx)
    upload: list[int] = []  # a streamed round's, client by client (a sample's are larger)
    result, accepted, agg = _aggregate_round(
        run, algorithm, config, down, before, data, weights, t, device, record, upload
    )
    run.rejections.extend(
        {
            "round": t + 1,
            "client_index": ids[r["client"]],
            **{k: r[k] for k in r if k != "client"},
        }
        for r in record
    )
    mostly_refused(t, len(refused_clients(record)), len(ids), config.max_rejected_share)
    kept = _roll_back(result.state, before, accepted)
    run.states = (
        tree_map(lambda t, r: r.to(t.dtype), run.states, kept)
        if everyone
        else scatter(run.states, idx, kept)
    )
    run.rejected = run.rejected.index_add(0, idx, (~accepted).to(torch.int64))
    if unjudged(algorithm, agg):  # too few units to judge: said, not silent (issue 36.4)
        agg = {**agg, "unjudged": 1.0}
    run.rounds_log.append({"round": t + 1, "cohort": len(ids), **agg})
    if algorithm.federated:  # a non-federated reference line communicates nothing
        one = num_bytes(result.reply, per_client_axis=True)
        run.bytes_up.append(upload[0] if upload else one * len(ids))
        run.bytes_down.append(num_bytes(down) * len(ids))
    return ids, result


def _aggregate_round(
    run: _Run,
    algorithm: Algorithm,
    config: EngineConfig,
    down: Tree,
    before: Tree,
    data: ClientData,
    weights: Tensor,
    t: int,
    device: torch.device,
    record: list[dict],
    upload: list[int] | None = None,
) -> tuple[ClientResult, Tensor, dict[str, float]]:
    """The cohort's client step and aggregation, streamed chunk by chunk when it must be
    (:func:`_streams`), else assembled; the new server into ``run``."""
    if _streams(algorithm, config, down, before, data, device, run.reply_size):
        result, run.server, accepted, agg = streamed.streamed_round(
            algorithm,
            run.server,
            down,
            before,
            data,
            weights,
            config.aggregation,
            config.chunk_size,
            record,
            upload,
            resolve_workers(config.workers, available_cores()),
        )
        return result, accepted, agg
    result = chunks.client_update(algorithm, down, before, data, config.chunk_size, device)
    state_ok = finite_rows(result.state)
    run.server, accepted, agg = aggregate(
        algorithm,
        run.server,
        down,
        result.reply,
        weights,
        config.aggregation,
        round_seed=client_round_seed(config.seed, t, 0, AGGREGATION),
        eligible=state_ok if state_ok.numel() else None,
        record=record,
    )
    return result, accepted, agg


def _evaluate_round(
    run: _Run,
    algorithm: Algorithm,
    fleet: FleetTensors,
    config: EngineConfig,
    device: torch.device,
    last: bool,
    done: _Round,
) -> None:
    """Every client's personal model scored after round ``done.t``: the history's rows (with
    the round's client metrics for those who trained) and the summary into ``run``; the
    last round's rows and models kept."""
    t = done.t
    rows, run.summary, evaluated = _evaluate(
        algorithm, fleet, done.server, done.states, config, t, device, last, units=run.units
    )
    if last:
        run.personal, run.last_rows = evaluated, rows
    # The round's client metrics (train loss, FedGMI's α, …) for those who trained.
    rejected = done.rejected.numpy().copy()
    run.history.add(round_block(rows, t + 1, rejected, done.metrics, done.ids))


def with_derived(
    algorithm: Algorithm, fleet: FleetTensors, chunk_size: int, device: torch.device = HOST
) -> FleetTensors:
    """The fleet with its training data's ``derived`` tensors (:class:`DerivesData`: what
    the algorithm's client step reads of the data alone, e.g. fedprior's moments), formed once
    here, ``chunk_size`` clients at a time, instead of in every round (issue 25.1). Unchanged
    when the algorithm derives nothing. A fleet that already has them is trusted only when
    the algorithm derives the same for its first client (another basis made them otherwise:
    they are formed again)."""
    if not isinstance(algorithm, DerivesData):
        return fleet
    train = fleet.train
    if train.derived is not None and train.num_clients:
        first = dataclasses.replace(train.select(torch.tensor([0])), derived=None)
        probe = algorithm.derive(first) or {}
        have = train.derived
        if probe.keys() == have.keys() and all(
            torch.equal(v, have[k][:1].to(v.device)) for k, v in probe.items()
        ):
            return fleet
        train = dataclasses.replace(train, derived=None)
    parts = (
        (int(rows[0]), chunks.on_device(device, algorithm.derive, chunks.data_to(part, device)))
        for rows in chunks.spans(train.num_clients, chunk_size)
        for part in (train if len(rows) == train.num_clients else train.select(rows),)
    )
    first = next(parts, None)
    if first is None or first[1] is None:  # nothing to derive: no stale tensors either
        return fleet if train is fleet.train else dataclasses.replace(fleet, train=train)
    derived = chunks.assemble(itertools.chain([first], parts), train.num_clients)
    return dataclasses.replace(fleet, train=dataclasses.replace(train, derived=derived))


def _streams(
    algorithm: Algorithm,
    config: EngineConfig,
    down: Tree,
    states: Tree,
    data: ClientData,
    device: torch.device,
    reply_size: list[int],
) -> bool:
    """Whether this round is summed chunk by chunk (:mod:`fedcal.engine.streamed`): the
    algorithm and policy allow it, the cohort runs in chunks on the host, and its assembled
    replies would exceed ``streamed.STREAM_ABOVE`` bytes (the equal-within-rounding path only
    where the memory needs it; below, the assembled path's canonical-order sums, to the bit).
    ``reply_size`` caches one client's reply bytes for the run (measured on client 0)."""
    n, size = data.num_clients, config.chunk_size
    if not 0 < size < n or not chunks.is_host(device):
        return False
    if streamed.eligible(algorithm, config.aggregation):
        return False
    if not reply_size:
        reply_size.append(streamed.reply_bytes(algorithm, down, states, data))
    return reply_size[0] * n > streamed.STREAM_ABOVE


def _roll_back(new: Tree, old: Tree, accepted: Tensor) -> Tree:
    """The new private state, with the old one of every client whose reply was rejected.

    Nothing rejected (the common case): the new state itself, made contiguous, not a
    copy of it — at 10,000 clients a fleet-sized copy is memory the chunks do not bound.
    """
    if bool(accepted.all()):
        return tree_map(lambda t: t.contiguous(), new)
    return tree_map(lambda n, o: torch.where(per_client(accepted, n), n, o.to(n.dtype)), new, old)
