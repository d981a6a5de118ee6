"""Each (method, seed) of a cell trained in its run folder: resumed from done.json or its
checkpoint, a failure recorded as a row with ``failed = 1`` (the method's other seeds are
not run: they would fail alike), the summary rewritten after each run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from fedcal.build import engine_settings
from fedcal.core import runnames
from fedcal.core.algorithm import Algorithm
from fedcal.engine.simulation import CheckpointError, EngineConfig, RunResult, simulate
from fedcal.experiment.builds import Cell
from fedcal.experiment.hooks import Hooks
from fedcal.experiment.plan import RunPlan
from fedcal.experiment.record import Trained, record_run
from fedcal.experiment.rundir import (
    CHECKPOINT_FILE,
    RunDirectoryError,
    _in_place,
    _ordered,
    _read_done,
    _run_name,
    _where,
    _write_csv,
    _write_text,
    one_line,
)
from fedcal.experiment.scoring import common_sensor_means


class Summary:
    """The summary rows so far (one per run), each with its per_sensor.csv and primary
    metric when it has one (a failed run has none), written to summary.csv."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: list[dict[str, Any]] = []
        self.runs: dict[int, tuple[Path, str]] = {}  # row → (per_sensor.csv, primary metric)

    def add(self, row: dict[str, Any], per_sensor: Path | None = None, metric: str = "") -> None:
        if per_sensor is not None:
            self.runs[len(self.rows)] = (per_sensor, metric)
        self.rows.append(row)

    def write(self) -> None:
        _write_csv(self.out / runnames.SUMMARY, _ordered(pd.DataFrame(self.rows)))

    def finish(self) -> pd.DataFrame:
        """The summary with the means over the common sensors (like with like, issue 34.4)."""
        summary = _ordered(common_sensor_means(pd.DataFrame(self.rows), self.runs))
        _write_csv(self.out / runnames.SUMMARY, summary)
        return summary


def run_method(
    plan: RunPlan, cell: Cell, method: str, algorithm: Algorithm, hooks: Hooks, summary: Summary
) -> None:
    """Every seed of ``method`` on ``cell``; after a failure the remaining seeds are skipped."""
    for seed in range(plan.config.seeds):
        if not run_seed(plan, cell, method, algorithm, seed, hooks, summary):
            break  # the other seeds of this method would fail alike


def run_seed(
    plan: RunPlan,
    cell: Cell,
    method: str,
    algorithm: Algorithm,
    seed: int,
    hooks: Hooks,
    summary: Summary,
) -> bool:
    """One run: read back if done, else trained and recorded; False if it failed."""
    out, tp, metric = plan.out, cell.train_points, cell.task.primary_metric
    run_dir = _in_place(out, out / runnames.RUNS / _run_name(method, cell.labels, tp, seed))
    done = run_dir / runnames.DONE
    if done.exists():
        summary.add(_read_done(done, out), run_dir / runnames.PER_SENSOR, metric)
        return True
    run_dir.mkdir(parents=True, exist_ok=True)
    engine = EngineConfig(**engine_settings(plan.config), seed=seed, aggregation=plan.policy)
    label = f"{method}{_where(cell.labels)} tp={tp or 'all'} seed={seed}"
    try:
        result = train(plan, cell, algorithm, engine, run_dir, hooks.progress(label))
    except (KeyboardInterrupt, MemoryError, RunDirectoryError):
        raise
    except Exception as err:  # one method's failure must not end the others
        reason = one_line(err)
        _write_text(run_dir / "failed.txt", reason + "\n")
        hooks.fail(label, reason)
        failed = {"method": method, "seed": seed, "train_points": tp, "failed": 1}
        summary.add({**cell.labels, **failed})
        summary.write()
        return False
    trained = Trained(method, algorithm, seed, label, run_dir, result)
    summary.add(record_run(plan, cell, trained, hooks), run_dir / runnames.PER_SENSOR, metric)
    summary.write()
    return True


def train(
    plan: RunPlan,
    cell: Cell,
    algorithm: Algorithm,
    engine: EngineConfig,
    run_dir: Path,
    on_round: Any,
) -> RunResult:
    """The engine's run, checkpointed in ``run_dir`` (a bad checkpoint: RunDirectoryError)."""
    try:
        return simulate(
            algorithm,
            cell.tensors,
            engine,
            on_round=on_round,
            checkpoint=run_dir / CHECKPOINT_FILE,
            checkpoint_every=plan.config.engine.checkpoint_every,
        )
    except CheckpointError as err:
        raise RunDirectoryError(
            f"checkpoint {err.path}: {err.problem}: remove {plan.out} (or only that "
            "checkpoint, to redo that run) or choose another --out"
        ) from None
