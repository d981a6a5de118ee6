"""A run's checkpoint: its whole state every few rounds (tensors and JSON, no pickle,
checksummed, written atomically) and the fingerprint that ties it to its run (algorithm as
configured, schedule, data).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor

from fedcal.core.algorithm import Algorithm
from fedcal.core.tensorfile import TensorFileError, load_trees, save_trees
from fedcal.core.tree import Tree
from fedcal.engine.history import History
from fedcal.engine.settings import EngineSettings, resolve_eval_every
from fedcal.engine.tensors import FleetTensors


def _fingerprint(algorithm: Algorithm, fleet: FleetTensors, config: EngineSettings) -> str:
    """The run a checkpoint belongs to (``config``: the simulator's EngineConfig)."""
    # The algorithm as configured, not its class's repr: a method moved to a class of its
    # own that a setting selects (fedgmi_bayes) keeps resuming (Algorithm.configured_repr).
    h = hashlib.sha256(algorithm.configured_repr().encode())
    # Where and in how many chunks a run computes does not change its numbers: a run
    # may resume with another chunk size or device. (Fields in their order of before
    # EngineSettings: the fingerprints of existing checkpoints stay the same.)
    full = asdict(config)
    keys = ("rounds", "participation", "eval_every", "seed", "dtype", "init_seed", "aggregation")
    schedule = {k: full[k] for k in keys}
    # "auto" as the rounds it means for this fleet: the fingerprint of the schedule run
    schedule["eval_every"] = resolve_eval_every(schedule["eval_every"], fleet.num_clients)
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
    history: History,
    rejected: Tensor,
    rounds_log: list[dict],
    rejections: list[dict] | None = None,
    unscored: tuple[dict[str, Tensor], list[int]] | None = None,
) -> None:
    """Tensors and JSON only (no pickle), checksummed, written atomically.

    ``rejected`` counts, per client, the rounds its reply was rejected; ``rounds_log``
    is the aggregation's per-round record, ``rejections`` each rejection with its reason;
    ``unscored``: the round's client metrics and cohort when that round was not evaluated
    (a resumed run may have to score it late: simulation._Round).
    """
    columns, layout = history.saved()  # the history's arrays as tensors (issue 36.1)
    trees = {
        "server": server,
        "states": states,
        "rejected": {"rounds": rejected},
        "history": columns,
    }
    if unscored is not None:
        metrics, ids = unscored
        trees["unscored"] = {"metrics": metrics, "ids": torch.tensor(ids, dtype=torch.int64)}
    save_trees(
        path,
        trees,
        {"fingerprint": fingerprint, "round": round_done, "elapsed": elapsed},
        {"history": layout, "aggregation": rounds_log, "rejections": rejections or []},
    )


def load_checkpoint(path: Path, fingerprint: str) -> tuple:
    """``(server, states, history, round, elapsed, rejected, rounds_log, rejections,
    unscored)`` of this very run. ``unscored``: ``(metrics, ids)`` of its last round when
    that round was not evaluated, else None; a checkpoint of before rejections were recorded
    has none; of before the history's columns, its rows are read into columns."""
    try:
        trees, meta, blobs = load_trees(path)
        same = meta["fingerprint"] == fingerprint
        history = History.restored(trees.get("history", {}), blobs["history"])
        saved = (trees["server"], trees["states"], history)
        round_done, elapsed = int(meta["round"]), float(meta["elapsed"])
        extra = (
            trees["rejected"]["rounds"],
            list(blobs["aggregation"]),
            list(blobs.get("rejections", [])),
            _unscored(trees.get("unscored")),
        )
    except TensorFileError as e:
        raise CheckpointError(path, e.problem) from None
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CheckpointError(path, f"incomplete ({type(e).__name__}: {e})") from None
    if not same:
        raise CheckpointError(path, "belongs to another run (algorithm, data or config differ)")
    return (*saved, round_done, elapsed, *extra)


def _unscored(tree: dict | None) -> tuple[dict[str, Tensor], list[int]] | None:
    """A checkpoint's unevaluated last round: its client metrics and cohort (None: none)."""
    if tree is None:
        return None
    return dict(tree["metrics"]), [int(i) for i in tree["ids"].tolist()]
