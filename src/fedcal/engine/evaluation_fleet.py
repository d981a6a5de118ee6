"""Every unit of a fleet scored after a round, chunk by chunk: the simulator's evaluation step
(:func:`evaluate_fleet`; a cohort's scoring itself is :mod:`fedcal.engine.evaluation`), its
rows as one block of columns (:mod:`fedcal.engine.history`, issue 36.1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from fedcal.core.algorithm import Algorithm
from fedcal.core.tree import Tree, gather
from fedcal.engine import chunks
from fedcal.engine.evaluation import evaluate_cohort
from fedcal.engine.history import Block, evaluation_block
from fedcal.engine.schedule import personalize_seeds
from fedcal.engine.tensors import FleetTensors


class Scheduled(Protocol):
    """What the evaluation reads of a run's settings (the simulator's ``EngineConfig``)."""

    seed: int
    chunk_size: int


def seeds_for(
    algorithm: Algorithm, seeds: Callable[..., tuple[int, ...]], seed: int, t: int, ids
) -> tuple[int, ...]:
    """The clients' seeds of round ``t`` (``train_seeds``/``personalize_seeds``), or zeros
    for an algorithm that reads none (:attr:`Algorithm.reads_seeds`)."""
    return seeds(seed, t, ids) if algorithm.reads_seeds else (0,) * len(ids)


def evaluate_fleet(
    algorithm: Algorithm,
    fleet: FleetTensors,
    server: Tree,
    states: Tree,
    config: Scheduled,
    t: int,
    device: torch.device,
    keep_personal: bool = False,
    personal: Tree | None = None,
    units: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[Block, dict, Tree]:
    """Per-client rows (as columns: :func:`~fedcal.engine.history.evaluation_block`) and
    the summary of every client's personal model after round ``t``;
    the personal models too with ``keep_personal`` (else ``{}``). Runs ``config.chunk_size``
    clients at a time: personalizing (e.g. fine-tuning) and predicting every row of a large
    fleet at once would hold (clients, rows, hidden) activations. Given ``personal`` (the
    whole fleet's models), scores those instead of personalizing. ``units``: the fleet's
    :func:`unit_columns`, made once by the run."""
    n = fleet.num_clients
    down = algorithm.broadcast(server)
    train_all = fleet.train.with_seeds(
        seeds_for(algorithm, personalize_seeds, config.seed, t, range(n))
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
    # Each metric one array (no dict per unit: 100,000 units × ~20 columns, issue 36.1).
    index, clients = unit_columns(fleet) if units is None else units
    rows = evaluation_block(index, clients, test, train, model_ok)
    key = algorithm.task.primary_metric
    summary = {
        f"test_{key}_mean": float(test[key].mean()),
        f"test_{key}_worst": float(test[key].max()),
        f"train_{key}_mean": float(train[key].mean()),
    }
    return rows, summary, out["personal"]


def unit_columns(fleet: FleetTensors) -> tuple[np.ndarray, np.ndarray]:
    """The fleet's unit indices and names as arrays; a run makes them once and every
    evaluated round's history block shares them (no copy per round)."""
    names = np.empty(len(fleet.client_ids), dtype=object)
    names[:] = list(fleet.client_ids)
    return np.arange(len(names), dtype=np.int64), names
