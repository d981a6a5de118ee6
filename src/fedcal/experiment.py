"""Experiments: methods × seeds (× calibration-point budgets) on one fleet, in a run directory.

Layout of a run directory::

    config.json            resolved configuration (refuses to mix with another one)
    fleet.json             where the data came from (file or simulator settings)
    summary.csv            one row per (method, train_points, seed), rewritten after each run
    runs/<method>_tp<N>_seed<S>/
        metrics.csv        per round and sensor: test/train errors, train loss
        per_sensor.csv     final errors of each sensor's personalized model
        model.pt           personalized weights of every sensor, scaler, model settings
        valid_range.json   per sensor, the span of its calibration points (exports carry it)
        done.json          the summary row; written last, so a run without it is redone
        checkpoint.pt      while running (removed when done): resume point

Every file is written atomically (temporary file, then rename): an interrupted
or failed run never leaves a half-written file, and results already written
stay intact. Running the same command again resumes: finished runs are read
back, an interrupted run continues from its checkpoint with the same numbers.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from fedcal.algorithms import REGISTRY, get
from fedcal.config import ConfigError, RunConfig
from fedcal.core.algorithm import Algorithm
from fedcal.core.classification import ClassificationTask
from fedcal.core.task import Task
from fedcal.core.tree import unstack
from fedcal.data.fleet import SPLIT_COLUMN, Fleet
from fedcal.engine.simulation import EngineConfig, FleetTensors, RunResult, prepare, simulate
from fedcal.models import build_model
from fedcal.models.basis import Basis, whitened

HIGHER_IS_BETTER = {"accuracy"}  # every other metric is an error: its worst sensor is the max

SUMMARY_COLUMNS = [
    "method",
    "seed",
    "train_points",
    "rmse_mean",
    "rmse_worst",
    "mae_mean",
    "max_abs_worst",
    "rmse_mean_pct_fs",
    "max_abs_worst_pct_fs",
    "wall_s",
    "bytes_up_per_round",
    "bytes_down_per_round",
]


def load_data(config: RunConfig) -> Fleet:
    """The fleet named by the configuration: a file, or the embedded simulator."""
    d = config.data
    if d.path == "builtin:digits":
        from fedcal.data.digits import digits_fleet

        return digits_fleet(seed=config.fleet.seed)
    if d.path:
        from fedcal.data.loader import load_fleet

        fleet = load_fleet(
            d.path,
            features=d.features,
            target=d.target,
            client_column=d.client_column,
            split_column=d.split_column,
            test_fraction=d.test_fraction,
            seed=d.split_seed,
        )
    else:
        from fedcal.data.simulator import FleetSpec, simulate_fleet

        f = config.fleet
        spec = FleetSpec(
            num_sensors=f.num_sensors,
            family=f.family,
            preset=f.preset,
            heterogeneity=f.heterogeneity,
            num_lots=f.num_lots,
            test_design=f.test_design,
        )
        fleet = simulate_fleet(spec, seed=f.seed)
    return fleet


def task_kind(fleet: Fleet) -> str:
    return "classification" if fleet.meta.get("task") == "classification" else "regression"


def build_task(
    config: RunConfig,
    num_features: int,
    meta: dict | None = None,
    train_inputs: list | None = None,
) -> Task:
    """The model and its head split.

    ``meta`` (the fleet's) says whether this is a classification task and how many
    classes it has; ``train_inputs`` (each client's scaled training inputs) are
    read only by a whitened basis, which needs the fleet's (federated) moments of
    its terms.
    """
    m = config.model
    meta = meta or {}
    if meta.get("task") == "classification":
        if m.family != "classifier":
            raise ConfigError("a classification fleet needs [model] family = 'classifier'")
        model = build_model(m.family, num_features, int(meta["num_classes"]), hidden=m.hidden)
        return ClassificationTask(model, head_layers=m.head_layers)
    model = build_model(
        m.family,
        num_features,
        1,
        hidden=m.hidden,
        activation=m.activation,
        poly_orders=m.poly_orders,
    )
    if m.whiten:
        if not isinstance(model, Basis):
            raise ConfigError("[model] whiten = true needs family = 'basis'")
        if train_inputs is None:
            raise ConfigError("[model] whiten = true needs the fleet's training inputs")
        model = whitened(model, train_inputs)
    return Task(model, head_layers=m.head_layers)


def client_inputs(tensors: FleetTensors) -> list:
    """Each client's real (unpadded) scaled training inputs."""
    train = tensors.train
    return [train.x[c, :n] for c, n in enumerate(train.count.tolist())]


def method_settings(name: str, config: RunConfig) -> tuple[type[Algorithm], dict[str, Any]]:
    """The registered class behind ``name`` and the parameters the config sets for it.

    The shared ``[train]`` recipe applies where the class has the field; a
    variant (``base = …``) starts from its base's table; the method's own
    table wins. Parameters not returned keep the class defaults.
    """
    own = dict(config.method_params.get(name, {}))
    base = own.pop("base", name)
    cls = get(base)
    if base != name:
        own = {**config.method_params.get(base, {}), **own}
    known = {f.name for f in dataclasses.fields(cls)} - {"task"}
    values: dict[str, Any] = {k: v for k, v in asdict(config.train).items() if k in known}
    unknown = sorted(set(own) - known)
    if unknown:
        raise ConfigError(
            f"[methods.{name}]: unknown parameter(s) {', '.join(unknown)}; "
            f"{name} takes: {', '.join(sorted(known))}"
        )
    values.update(own)
    return cls, values


def build_algorithm(name: str, config: RunConfig, task: Task) -> Algorithm:
    """The named method with the shared local recipe and its own parameters from the config.

    A name may also be a *variant* defined in the config: a ``[methods.<name>]``
    table with ``base = "<registered method>"`` and the parameters it changes
    (e.g. FedGMI's ablations).
    """
    cls, values = method_settings(name, config)
    try:
        return cls(task=task, **values)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"[methods.{name}]: {err}") from None


def check_methods(
    methods: Sequence[str], config: RunConfig | None = None, task_kind: str = "regression"
) -> list[str]:
    """Expand ``all`` (every method and config variant for ``task_kind``); refuse unknown names."""
    variants = {
        name: params["base"]
        for name, params in (config.method_params.items() if config else [])
        if "base" in params
    }
    if list(methods) == ["all"]:
        names = [n for n in sorted(REGISTRY) if REGISTRY[n].task_kind == task_kind]
        names += [
            v for v, b in variants.items() if b in REGISTRY and REGISTRY[b].task_kind == task_kind
        ]
    else:
        names = list(methods)
    unknown = [m for m in names if m not in REGISTRY and variants.get(m) not in REGISTRY]
    if unknown:
        raise ConfigError(
            f"unknown method(s) {', '.join(unknown)}; known: {', '.join(sorted(REGISTRY))}"
        )
    return names


def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _write_text(path: Path, text: str) -> None:
    _write_atomic(path, lambda p: p.write_text(text))


def _write_csv(path: Path, frame: pd.DataFrame) -> None:
    _write_atomic(path, lambda p: frame.to_csv(p, index=False))


def full_scale(fleet: Fleet) -> float:
    """The calibrated span of the target (max − min over the fleet's reference values)."""
    values = fleet.frame[fleet.target].to_numpy(float)
    return float(values.max() - values.min())


def valid_ranges(fleet: Fleet) -> dict[str, Any]:
    """Per sensor, the span of its calibration points: {sensor: {column: [min, max]}}.

    Inputs and target; a model is only validated inside this range, so exports carry it.
    """
    train = fleet.frame[fleet.frame[SPLIT_COLUMN] == "train"]
    columns = [*fleet.features, fleet.target]
    spans = train.groupby(fleet.client_column, sort=False)[columns].agg(["min", "max"])
    return {
        str(sensor): {c: [float(row[(c, "min")]), float(row[(c, "max")])] for c in columns}
        for sensor, row in spans.iterrows()
    }


def summary_row(
    method: str, seed: int, train_points: int, result: RunResult, fs: float, task: Task
) -> dict[str, Any]:
    final = pd.DataFrame(result.final)
    row: dict[str, Any] = {"method": method, "seed": seed, "train_points": train_points}
    for col in final.columns:
        if col.startswith("test_"):
            name = col.removeprefix("test_")
            row[f"{name}_mean"] = float(final[col].mean())
            worst = final[col].min() if name in HIGHER_IS_BETTER else final[col].max()
            row[f"{name}_worst"] = float(worst)
    if task.kind == "regression":
        row["rmse_mean_pct_fs"] = 100.0 * row["rmse_mean"] / fs
        row["max_abs_worst_pct_fs"] = 100.0 * row["max_abs_worst"] / fs
    row["wall_s"] = result.wall_s
    row["bytes_up_per_round"] = result.bytes_up_per_round
    row["bytes_down_per_round"] = result.bytes_down_per_round
    return row


def save_models(
    path: Path,
    result: RunResult,
    tensors: FleetTensors,
    config: RunConfig,
    algorithm: Algorithm,
    method: str,
    seed: int,
) -> None:
    per_client = unstack(result.personal)
    payload = {
        "method": method,
        "seed": seed,
        "params": {cid: p for cid, p in zip(tensors.client_ids, per_client, strict=True)},
        "model": asdict(config.model),
        "model_object": algorithm.task.model,
        "head_layers": algorithm.task.head_layers,
        "method_params": config.method_params.get(method, {}),
        "scaler": tensors.scaler.to_dict(),
    }
    _write_atomic(path, lambda p: torch.save(payload, p))


def run_experiment(
    config: RunConfig,
    fleet: Fleet,
    out: Path,
    methods: Sequence[str],
    train_points: Sequence[int] = (0,),
    on_progress: Callable[[str, int, dict], None] | None = None,
    on_skip: Callable[[str, str], None] | None = None,
) -> pd.DataFrame:
    """Run every (train_points, method, seed); return (and write) the summary table.

    With ``methods=["all"]`` a method that cannot run on this model (e.g. one
    that needs a shared body when the model is all head) is skipped and
    reported through ``on_skip(method, reason)``; a method named explicitly
    that cannot run is an error.
    """
    expand_all = list(methods) == ["all"]
    methods = check_methods(methods, config, task_kind(fleet))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    resolved = {**config.to_dict(), "methods": methods, "train_points_sweep": list(train_points)}
    config_path = out / "config.json"
    text = json.dumps(resolved, indent=2, sort_keys=True, default=list)
    if config_path.exists() and json.loads(config_path.read_text()) != json.loads(text):
        raise ConfigError(
            f"{out} holds a run with another configuration; choose another --out "
            "or remove it (nothing was changed)"
        )
    _write_text(config_path, text)
    _write_text(out / "fleet.json", json.dumps(fleet.meta, indent=2, sort_keys=True, default=str))
    fs = full_scale(fleet)
    rows: list[dict[str, Any]] = []
    for tp in train_points:
        subset = fleet.with_train_points(tp or None, seed=config.data.split_seed)
        tensors = prepare(subset, config.data.scaling, config.engine.dtype)
        task = build_task(config, tensors.train.x.shape[-1], subset.meta, client_inputs(tensors))
        for method in methods:
            try:
                algorithm = build_algorithm(method, config, task)
            except ConfigError as err:
                if not expand_all:
                    raise
                if on_skip is not None:
                    on_skip(method, str(err))
                continue
            for seed in range(config.seeds):
                run_dir = out / "runs" / f"{method}_tp{tp}_seed{seed}"
                done = run_dir / "done.json"
                if done.exists():
                    rows.append(json.loads(done.read_text()))
                    continue
                run_dir.mkdir(parents=True, exist_ok=True)
                engine = EngineConfig(
                    rounds=config.engine.rounds,
                    participation=config.engine.participation,
                    eval_every=config.engine.eval_every,
                    seed=seed,
                    dtype=config.engine.dtype,
                )
                label = f"{method} tp={tp or 'all'} seed={seed}"
                result = simulate(
                    algorithm,
                    tensors,
                    engine,
                    on_round=(lambda t, s, label=label: on_progress(label, t, s))
                    if on_progress
                    else None,
                    checkpoint=run_dir / "checkpoint.pt",
                    checkpoint_every=config.engine.checkpoint_every,
                )
                history = pd.DataFrame(result.history)
                history.insert(0, "method", method)
                history.insert(1, "seed", seed)
                _write_csv(run_dir / "metrics.csv", history)
                final = pd.DataFrame(result.final)
                final.insert(0, "method", method)
                final.insert(1, "seed", seed)
                _write_csv(run_dir / "per_sensor.csv", final)
                save_models(run_dir / "model.pt", result, tensors, config, algorithm, method, seed)
                if task.kind == "regression":
                    ranges = json.dumps(valid_ranges(subset), indent=1)
                    _write_text(run_dir / "valid_range.json", ranges)
                row = summary_row(method, seed, tp, result, fs, task)
                _write_text(done, json.dumps(row, indent=2))
                (run_dir / "checkpoint.pt").unlink(missing_ok=True)
                rows.append(row)
                _write_csv(out / "summary.csv", _ordered(pd.DataFrame(rows)))
    summary = _ordered(pd.DataFrame(rows))
    _write_csv(out / "summary.csv", summary)
    return summary


def _ordered(frame: pd.DataFrame) -> pd.DataFrame:
    first = [c for c in SUMMARY_COLUMNS if c in frame.columns]
    rest = [c for c in frame.columns if c not in first]
    return frame[first + rest]
