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
import hashlib
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from pydantic import InstanceOf
from torch import Tensor

from fedcal.core.aggregation import PLAIN, AggregationPolicy, aggregate, finite_rows
from fedcal.core.algorithm import Algorithm
from fedcal.core.data import HOST, ClientData, client_round_seed
from fedcal.core.schema import Seed, checked
from fedcal.core.tensorfile import TensorFileError, load_trees, save_trees
from fedcal.core.tree import Tree, expand, gather, num_bytes, per_client, scatter, tree_map
from fedcal.data.fleet import Fleet
from fedcal.data.scaling import (
    Scaler,
    client_moments,
    fit_scaler,
    needs_moments,
    scaler_from_moments,
)
from fedcal.engine import chunks, streamed
from fedcal.engine.evaluation import evaluate_cohort
from fedcal.engine.memory import keep_freed_memory
from fedcal.engine.schedule import (
    cohort,
    evaluates,
    final_row,
    history_row,
    personalize_seeds,
    result_row,
    train_seeds,
)
from fedcal.engine.settings import (
    EngineSettings,
    mostly_refused,
    refused_clients,
    unjudged,
)

DTYPES = {"float32": torch.float32, "float64": torch.float64}
AGGREGATION = 3  # seed purpose of the server's DP noise (clients use 0.., see core.data)


@dataclass(frozen=True)
class FleetTensors:
    """A fleet as padded tensors (scaled), with the scaler to undo the target scale."""

    train: ClientData
    test: ClientData
    scaler: Scaler
    client_ids: tuple[str, ...]
    target_unit: str = ""

    @property
    def num_clients(self) -> int:
        return len(self.client_ids)


def prepare(fleet: Fleet, scaling: str = "auto", dtype: str = "float32") -> FleetTensors:
    """Scale a fleet (see :mod:`fedcal.data.scaling`) and pad it into tensors."""
    train = fleet.arrays("train")
    test = fleet.arrays("test")
    # Class labels (meta "task" = "classification") are indices, not quantities.
    classification = fleet.meta.get("task") == "classification"
    scaler = fit_scaler(fleet.features, fleet.target, train, scaling, not classification)
    torch_dtype = DTYPES[dtype]

    def scaled(arrays: list[tuple[np.ndarray, np.ndarray]], split: str) -> ClientData:
        return ClientData.from_arrays(
            [(scaler.x(x), scaler.y(y)) for x, y in arrays],
            dtype=torch_dtype,
            branch=fleet.branch_signs(split),  # None without a direction column
            time=fleet.row_times(split),  # None without a time column
        )

    unit = fleet.target.rsplit("_", 1)[-1] if "_" in fleet.target else ""
    return FleetTensors(
        scaled(train, "train"),
        scaled(test, "test"),
        scaler,
        tuple(map(str, fleet.client_ids)),
        unit,
    )


def prepare_chunks(
    parts: Callable[[], Iterable[Fleet]], scaling: str = "auto", dtype: str = "float32"
) -> FleetTensors:
    """:func:`prepare` of the fleet whose sensors ``parts()`` yields a few at a time (disjoint
    sensor sets, in order: ``simulate_chunks``' frames, a Parquet file's row groups), without
    the whole fleet's frame (issue 25.1: 100,000 units). The same tensors as :func:`prepare`
    of their concatenation (tested to the bit). ``parts`` is called twice when the scaler
    needs federated statistics (a first pass sums each client's, :func:`client_moments`),
    once when every column has a physical range (the barometer)."""
    chunks_ = iter(parts())
    first = next(chunks_, None)
    if first is None:
        raise ValueError("prepare_chunks: the fleet has no sensors")
    classification = first.meta.get("task") == "classification"
    moments: list[dict[str, np.ndarray]] = []
    if needs_moments(first.features, first.target, scaling, not classification):
        for part in parts():  # a first pass: each client's sums only
            moments += [client_moments(x, y) for x, y in part.arrays("train")]
    scaler = scaler_from_moments(first.features, first.target, moments, scaling, not classification)
    torch_dtype = DTYPES[dtype]
    train: list[ClientData] = []
    test: list[ClientData] = []
    ids: list[str] = []
    seen: set[str] = set()
    for part in itertools.chain([first], chunks_):
        for split, out in (("train", train), ("test", test)):
            out.append(
                ClientData.from_arrays(
                    [(scaler.x(x), scaler.y(y)) for x, y in part.arrays(split)],
                    dtype=torch_dtype,
                    branch=part.branch_signs(split),
                    time=part.row_times(split),
                )
            )
        new = list(map(str, part.client_ids))
        again = next((i for i in new if i in seen), None)
        if again is not None:  # two units with one id: a sensor's rows split over two parts
            raise ValueError(f"prepare_chunks: sensor {again!r} is in two parts of the fleet")
        seen.update(new)
        ids += new
    unit = first.target.rsplit("_", 1)[-1] if "_" in first.target else ""
    return FleetTensors(_stacked(train), _stacked(test), scaler, tuple(ids), unit)


def _stacked(parts: list[ClientData]) -> ClientData:
    """Chunks' padded data as one cohort, padded to the longest client (zeros, as
    :meth:`ClientData.from_arrays` pads); each chunk freed once copied."""
    rows = max(p.x.shape[1] for p in parts)
    n = sum(p.num_clients for p in parts)

    def joined(get: Callable[[ClientData], Tensor | None]) -> Tensor | None:
        if get(parts[0]) is None:
            return None
        sample = get(parts[0])
        out = sample.new_zeros((n, rows, *sample.shape[2:]))
        at = 0
        for p in parts:
            t = get(p)
            out[at : at + t.shape[0], : t.shape[1]] = t
            at += t.shape[0]
        return out

    x, y = joined(lambda p: p.x), joined(lambda p: p.y)
    branch, time_ = joined(lambda p: p.branch), joined(lambda p: p.time)
    count = torch.cat([p.count for p in parts])
    return ClientData(x, y, count, (0,) * n, tuple(range(n)), branch, time_)


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
    """Everything a run produced; ``history`` rows are per round and client."""

    history: list[dict]
    final: list[dict]
    personal: Tree
    server: Tree
    states: Tree
    wall_s: float
    bytes_up_per_round: float
    bytes_down_per_round: float
    rounds_done: int = 0
    extra: dict = field(default_factory=dict)


def _fingerprint(algorithm: Algorithm, fleet: FleetTensors, config: EngineConfig) -> str:
    # The algorithm as configured, not its class's repr: a method moved to a class of its
    # own that a setting selects (fedgmi_bayes) keeps resuming (Algorithm.configured_repr).
    h = hashlib.sha256(algorithm.configured_repr().encode())
    # Where and in how many chunks a run computes does not change its numbers: a run
    # may resume with another chunk size or device. (Fields in their order of before
    # EngineSettings: the fingerprints of existing checkpoints stay the same.)
    full = asdict(config)
    keys = ("rounds", "participation", "eval_every", "seed", "dtype", "init_seed", "aggregation")
    schedule = {k: full[k] for k in keys}
    if isinstance(schedule["aggregation"], dict):  # a DP run's secret noise seed: new per run
        schedule["aggregation"].pop("dp_noise_secret", None)
    h.update(repr(schedule).encode())
    for t in (fleet.train.x, fleet.train.y, fleet.test.x, fleet.test.y):
        h.update(t.numpy().tobytes())
    if fleet.train.branch is not None:  # sweep directions change fedprior_branch's data
        h.update(fleet.train.branch.numpy().tobytes())
    if fleet.train.time is not None:  # row times change fedprior_drift's data
        h.update(fleet.train.time.numpy().tobytes())
    return h.hexdigest()


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (corrupt, or of another run).

    ``str()`` names the file, the problem and what to do; ``path`` and
    ``problem`` let a caller give its own advice.
    """

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path, self.problem = str(path), problem
        super().__init__(
            f"checkpoint {path}: {problem}; remove it to start this run afresh, "
            "or choose another output directory"
        )

    def __reduce__(self):
        return (type(self), (self.path, self.problem))


def save_checkpoint(
    path: Path,
    fingerprint: str,
    round_done: int,
    elapsed: float,
    server: Tree,
    states: Tree,
    history: list[dict],
    rejected: Tensor,
    rounds_log: list[dict],
    rejections: list[dict] | None = None,
) -> None:
    """Tensors and JSON only (no pickle), checksummed, written atomically.

    ``rejected`` counts, per client, the rounds its reply was rejected; ``rounds_log``
    is the aggregation's per-round record, ``rejections`` each rejection with its reason.
    """
    save_trees(
        path,
        {"server": server, "states": states, "rejected": {"rounds": rejected}},
        {"fingerprint": fingerprint, "round": round_done, "elapsed": elapsed},
        {"history": history, "aggregation": rounds_log, "rejections": rejections or []},
    )


def load_checkpoint(path: Path, fingerprint: str) -> tuple:
    """``(server, states, history, round, elapsed, rejected, rounds_log, rejections)`` of this
    very run (a checkpoint of before rejections were recorded: none)."""
    try:
        trees, meta, blobs = load_trees(path)
        same = meta["fingerprint"] == fingerprint
        saved = (trees["server"], trees["states"], list(blobs["history"]))
        round_done, elapsed = int(meta["round"]), float(meta["elapsed"])
        extra = (
            trees["rejected"]["rounds"],
            list(blobs["aggregation"]),
            list(blobs.get("rejections", [])),
        )
    except TensorFileError as e:
        raise CheckpointError(path, e.problem) from None
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(path, f"incomplete ({type(e).__name__}: {e})") from None
    if not same:
        raise CheckpointError(path, "belongs to another run (algorithm, data or config differ)")
    return (*saved, round_done, elapsed, *extra)


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
    # A closed-form method (Algorithm.one_shot) is done after one round: later rounds
    # would repeat it exactly, so they are not run.
    rounds = 1 if algorithm.one_shot else config.rounds
    dtype = DTYPES[config.dtype]
    device = chunks.resolve_device(config.device)
    n = fleet.num_clients
    init_gen = torch.Generator().manual_seed(
        config.seed if config.init_seed is None else config.init_seed
    )
    server = algorithm.server_init(algorithm.task.model.init(init_gen, dtype))
    states = tree_map(
        lambda t: t.contiguous().clone(),
        algorithm.client_init(expand(algorithm.broadcast(server), n)),
    )
    history: list[dict] = []
    start_round, elapsed = 0, 0.0
    fingerprint = _fingerprint(algorithm, fleet, config)
    if checkpoint is not None and Path(checkpoint).exists():
        (server, states, history, start_round, elapsed, rejected, rounds_log, rejections) = (
            load_checkpoint(Path(checkpoint), fingerprint)
        )
    else:
        rejected = torch.zeros(n, dtype=torch.int64)  # rounds each client's reply was rejected
        rounds_log: list[dict] = []
        rejections: list[dict] = []  # every rejection: round, client, reason, ratio, threshold

    fleet = with_derived(algorithm, fleet, config.chunk_size, device)
    counts = fleet.train.count.to(torch.float64)
    bytes_up, bytes_down = [], []
    reply_size: list[int] = []  # one client's reply bytes, measured once (_streams)
    t0 = time.perf_counter() - elapsed
    for t in range(start_round, rounds):
        idx = cohort(config.seed, t, n, config.participation)
        ids = idx.tolist()
        # The whole fleet in order (cohort() sorts): no gathered copy of every client's
        # state or data.
        everyone = len(ids) == n
        data = (fleet.train if everyone else fleet.train.select(idx)).with_seeds(
            _seeds(algorithm, train_seeds, config.seed, t, ids)
        )
        down = algorithm.broadcast(server)
        before = states if everyone else gather(states, idx)
        record: list[dict] = []
        if _streams(algorithm, config, down, before, data, device, reply_size):
            result, server, accepted, agg = streamed.streamed_round(
                algorithm,
                server,
                down,
                before,
                data,
                counts.index_select(0, idx),
                config.aggregation,
                config.chunk_size,
                record,
            )
        else:
            result = chunks.client_update(algorithm, down, before, data, config.chunk_size, device)
            state_ok = finite_rows(result.state)
            server, accepted, agg = aggregate(
                algorithm,
                server,
                down,
                result.reply,
                counts.index_select(0, idx),
                config.aggregation,
                round_seed=client_round_seed(config.seed, t, 0, AGGREGATION),
                eligible=state_ok if state_ok.numel() else None,
                record=record,
            )
        rejections.extend(
            {
                "round": t + 1,
                "client_index": ids[r["client"]],
                **{k: r[k] for k in r if k != "client"},
            }
            for r in record
        )
        mostly_refused(t, len(refused_clients(record)), len(ids), config.max_rejected_share)
        kept = _roll_back(result.state, before, accepted)
        states = (
            tree_map(lambda t, r: r.to(t.dtype), states, kept)
            if everyone
            else scatter(states, idx, kept)
        )
        rejected = rejected.index_add(0, idx, (~accepted).to(torch.int64))
        if unjudged(algorithm, agg):  # too few units to judge: said, not silent (issue 36.4)
            agg = {**agg, "unjudged": 1.0}
        rounds_log.append({"round": t + 1, "cohort": len(ids), **agg})
        if algorithm.federated:  # a non-federated reference line communicates nothing
            bytes_up.append(num_bytes(result.reply, per_client_axis=True) * len(ids))
            bytes_down.append(num_bytes(down) * len(ids))
        last = t == rounds - 1
        if evaluates(t, rounds, config.eval_every):  # always after the last round
            rows, summary, evaluated = _evaluate(
                algorithm, fleet, server, states, config, t, device, keep_personal=last
            )
            if last:
                personal, last_rows = evaluated, rows
            # The round's client metrics (train loss, FedGMI's α, …) for those who trained.
            values = {name: v.tolist() for name, v in result.metrics.items()}
            trained = {i: {name: v[j] for name, v in values.items()} for j, i in enumerate(ids)}
            history.extend(
                history_row(
                    row,
                    t + 1,
                    int(rejected[row["client_index"]]),
                    trained.get(row["client_index"], {}),
                    list(values),
                )
                for row in rows
            )
            if on_round is not None:
                on_round(t + 1, summary)
        if checkpoint is not None and (last or (t + 1) % checkpoint_every == 0):
            elapsed_now = time.perf_counter() - t0
            save_checkpoint(
                Path(checkpoint),
                fingerprint,
                t + 1,
                elapsed_now,
                server,
                states,
                history,
                rejected,
                rounds_log,
                rejections,
            )
    wall = time.perf_counter() - t0
    if start_round >= rounds:  # resumed after the last round: evaluate it here
        last_rows, _, personal = _evaluate(
            algorithm, fleet, server, states, config, rounds - 1, device, keep_personal=True
        )
    final = [final_row(row, int(rejected[row["client_index"]])) for row in last_rows]
    return RunResult(
        history=history,
        final=final,
        personal=personal,
        server=server,
        states=states,
        wall_s=wall,
        bytes_up_per_round=float(np.mean(bytes_up)) if bytes_up else 0.0,
        bytes_down_per_round=float(np.mean(bytes_down)) if bytes_down else 0.0,
        rounds_done=rounds,
        extra={"aggregation": rounds_log, "rejections": rejections},
    )


def _seeds(
    algorithm: Algorithm, seeds: Callable[..., tuple[int, ...]], seed: int, t: int, ids
) -> tuple[int, ...]:
    """The clients' seeds of round ``t`` (``train_seeds``/``personalize_seeds``), or zeros
    for an algorithm that reads none (:attr:`Algorithm.reads_seeds`)."""
    return seeds(seed, t, ids) if algorithm.reads_seeds else (0,) * len(ids)


def with_derived(
    algorithm: Algorithm, fleet: FleetTensors, chunk_size: int, device: torch.device = HOST
) -> FleetTensors:
    """The fleet with its training data's ``derived`` tensors (:attr:`Algorithm.derive`: what
    the algorithm's client step reads of the data alone, e.g. fedprior's moments), formed once
    here, ``chunk_size`` clients at a time, instead of in every round (issue 25.1). Unchanged
    when the algorithm derives nothing. A fleet that already has them is trusted only when
    the algorithm derives the same for its first client (another basis made them otherwise:
    they are formed again)."""
    if algorithm.derive is None:
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


def _evaluate(
    algorithm: Algorithm,
    fleet: FleetTensors,
    server: Tree,
    states: Tree,
    config: EngineConfig,
    t: int,
    device: torch.device,
    keep_personal: bool = False,
    personal: Tree | None = None,
) -> tuple[list[dict], dict, Tree]:
    """Per-client rows and the summary of every client's personal model after round ``t``;
    the personal models too with ``keep_personal`` (else ``{}``). Runs ``config.chunk_size``
    clients at a time: personalizing (e.g. fine-tuning) and predicting every row of a large
    fleet at once would hold (clients, rows, hidden) activations. Given ``personal`` (the
    whole fleet's models), scores those instead of personalizing."""
    n = fleet.num_clients
    down = algorithm.broadcast(server)
    train_all = fleet.train.with_seeds(
        _seeds(algorithm, personalize_seeds, config.seed, t, range(n))
    )
    whole = config.chunk_size <= 0 or config.chunk_size >= n
    given = personal

    def one_chunk(rows: Tensor) -> Tree:
        def mine(tree: Tree) -> Tree:
            return chunks.to_device(tree if whole else gather(tree, rows), device)

        train = train_all if whole else train_all.select(rows)
        test = fleet.test if whole else fleet.test.select(rows)
        out = evaluate_cohort(
            algorithm,
            chunks.to_device(down, device),
            {} if given is not None else mine(states),
            chunks.data_to(train, device),
            chunks.data_to(test, device),
            fleet.scaler,
            None if given is None else mine(given),
        )._asdict()
        return out if keep_personal else {**out, "personal": {}}

    # Chunk by chunk into the fleet's tensors: the chunks' personal models never coexist
    # with their concatenation.
    out = chunks.assemble(
        (
            (int(rows[0]), chunks.on_device(device, one_chunk, rows))
            for rows in chunks.spans(n, config.chunk_size)
        ),
        n,
    )
    test, train, model_ok = out["test"], out["train"], out["finite"]
    rows = [
        result_row(
            i,
            cid,
            {k: v[i] for k, v in test.items()},
            {k: v[i] for k, v in train.items()},
            bool(model_ok[i]),
        )
        for i, cid in enumerate(fleet.client_ids)
    ]
    key = algorithm.task.primary_metric
    summary = {
        f"test_{key}_mean": float(test[key].mean()),
        f"test_{key}_worst": float(test[key].max()),
        f"train_{key}_mean": float(train[key].mean()),
    }
    return rows, summary, out["personal"]
