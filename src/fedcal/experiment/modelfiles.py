"""A run's trained models as files: every sensor's personalized parameters
(model.safetensors, rebuilt from the run's configuration, no pickle) and the fitted
fleet prior with the run's context (:func:`export_state`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from fedcal.build import (
    FleetOutline,
    build_task,
)
from fedcal.config import ConfigError, RunConfig
from fedcal.core.algorithm import Algorithm
from fedcal.core.task import Task
from fedcal.core.tensorfile import TensorFileError, load_trees, save_trees
from fedcal.core.tree import flatten, unstack
from fedcal.data.fleet import SPLIT_COLUMN, Fleet
from fedcal.engine.simulation import (
    FleetTensors,
    RunResult,
)
from fedcal.prior.model import PriorModel, created_by


def save_models(
    path: Path,
    result: RunResult,
    tensors: FleetTensors,
    config: RunConfig,
    algorithm: Algorithm,
    method: str,
    seed: int,
    task_meta: dict | None = None,
) -> None:
    """Every sensor's personalized parameters (tensors) and how to rebuild the model (JSON).

    Nothing is pickled: the model is rebuilt from the run's configuration by
    :func:`rebuild_task`; what the configuration alone cannot give (a whitened
    basis's fleet moments) is stored as numbers.
    """
    model = algorithm.task.model
    whitening = None
    if getattr(model, "poly_center", None) is not None:
        whitening = {"poly_center": model.poly_center, "poly_transform": model.poly_transform}
    meta = {
        "method": method,
        "seed": seed,
        "client_ids": list(tensors.client_ids),
        "num_features": int(tensors.train.x.shape[-1]),
        "task_meta": {k: v for k, v in (task_meta or {}).items() if k in ("task", "num_classes")},
        "model": asdict(config.model),
        "model_repr": repr(model),
        "whitening": whitening,
        "head_layers": algorithm.task.head_layers,
        "method_params": config.method_params.get(method, {}),
        "scaler": tensors.scaler.to_dict(),
    }
    save_trees(path, {"params": result.personal}, meta)


def rebuild_task(config: RunConfig, meta: dict, path: Path) -> Task:
    """The task a model file was trained with, rebuilt from its run's config and its metadata."""
    cfg = replace(config, model=replace(config.model, whiten=False))
    task = build_task(cfg, int(meta["num_features"]), meta.get("task_meta") or {})
    if meta.get("whitening"):
        w = meta["whitening"]
        model = replace(
            task.model,
            poly_center=tuple(w["poly_center"]),
            poly_transform=tuple(tuple(r) for r in w["poly_transform"]),
        )
        task = type(task)(model, head_layers=task.head_layers)
    if repr(task.model) != meta.get("model_repr"):
        raise TensorFileError(path, "its model does not match the run's config.json")
    return task


def load_model_file(path: Path, config: RunConfig) -> tuple[Task, dict[str, dict], dict]:
    """``(task, {sensor id: parameters}, metadata)`` of a file written by :func:`save_models`."""
    trees, meta, _ = load_trees(path)
    try:
        task = rebuild_task(config, meta, path)
        per_client = unstack(trees["params"])
        params = dict(zip(meta["client_ids"], per_client, strict=True))
    except (KeyError, TypeError, ValueError, ConfigError) as e:
        if isinstance(e, TensorFileError):
            raise
        raise TensorFileError(path, f"does not fit its run ({type(e).__name__}: {e})") from None
    expected = {
        k: tuple(v.shape)
        for k, v in flatten(task.model.init(torch.Generator(), torch.float64)).items()
    }
    shapes = {s: {k: tuple(v.shape) for k, v in flatten(p).items()} for s, p in params.items()}
    # Methods with a parameterization of their own (polynomial, fedprior: coefficients and
    # covariances) do not use the task's model: their sensors must at least agree.
    own = not any(set(expected) & set(got) for got in shapes.values())
    for sensor, got in shapes.items():
        if own:
            ok = got == next(iter(shapes.values()))
        else:
            ok = set(expected) <= set(got) and all(got[k] == expected[k] for k in expected)
        if not ok:
            raise TensorFileError(path, f"parameters of sensor {sensor!r} do not fit the model")
    return task, params, meta


def export_state(
    algorithm: Algorithm,
    server: dict,
    fleet: Fleet | FleetOutline,
    tensors: FleetTensors,
    method: str,
    choose: str = "",
) -> PriorModel | None:
    """The algorithm's reusable server state (fedprior's fleet prior) as the fitted value.

    ``choose``: the time-respecting choice the configuration asked for; "auto" is recorded
    as "auto" (calibrate resolves it by its own data's time column), not as this run's.

    Adds what is needed to apply it to new units: the method and its parameters,
    feature and target names, the scaler, and the range of each input the fleet
    was calibrated over (inputs outside it are extrapolation); and its provenance
    (fleet size, units per number of calibration points, fedcal's version). The
    value is validated as a loaded file is (:class:`fedcal.prior.model.PriorModel`):
    a prior that could not be read back is a RunFileError here, not a file.
    """
    state = algorithm.export_state(server)
    if state is None:
        return None
    names = list(fleet.features)
    if isinstance(fleet, FleetOutline):
        input_range = fleet.input_range
    else:
        train = fleet.frame[fleet.frame[SPLIT_COLUMN] == "train"]
        input_range = {c: [float(train[c].min()), float(train[c].max())] for c in names}

    def named(terms: list[str]) -> list[str]:  # 'P2(x0)·P1(x1)' → 'P2(frequency_hz)·…'
        return [re.sub(r"x(\d+)", lambda m: names[int(m.group(1))], t) for t in terms]

    for key in ("term_names", "branch_term_names"):
        if key in state:
            state[key] = named(state[key])
    if state.get("identification"):
        state["identification"]["weak_terms"] = named(state["identification"]["weak_terms"])
    doc = {
        **state,
        "method": method,
        "method_params": {
            f.name: getattr(algorithm, f.name)
            for f in dataclasses.fields(algorithm)
            if f.name != "task"
        },
        "features": names,
        "target": fleet.target,
        "sensor_column": fleet.client_column,  # calibrate/predict read new units' ids from it
        "scaler": tensors.scaler.to_dict(),
        "input_range": input_range,
        "num_units": fleet.num_clients,
        "design_counts": _design_counts(tensors, fleet.num_clients),
        "created_by": created_by(),
    }
    if "choose" in doc["method_params"] and choose == "auto":  # calibrate resolves it by its data
        doc["method_params"]["choose"] = "auto"
    return PriorModel.from_dict(doc, f"{method}: the trained prior")


def _asked_choose(config: RunConfig, method: str) -> str:
    """The ``choose`` the configuration gives ``method`` (or its base's table), "auto" if none."""
    params = config.method_params.get(method, {})
    base = config.method_params.get(str(params.get("base", "")), {})
    return str(params.get("choose", base.get("choose", "auto")))


def _design_counts(tensors: FleetTensors, units: int) -> dict[str, int] | None:
    """{calibration points: units with that many}, ascending (None: counts not at hand)."""
    count = tensors.train.count.cpu().numpy()
    if len(count) != units:
        return None
    points, many = np.unique(count.astype(int), return_counts=True)
    return {str(int(p)): int(m) for p, m in zip(points, many, strict=True)}
