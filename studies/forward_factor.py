"""What factor on σ each period asks (issue 34, the interval after calibration).

For a network that ``studies/realnets.py`` wrote (``<out>/<net>/run.toml`` and its
``network.csv``), fedprior is trained in-process with the model's own σ after calibration
(``choice_interval = "off"``) and, with its final prior, each unit's two forward folds (fit
on its earlier rows, score its later ones: :meth:`TimeChoice.folds`) and its future
quarter are scored: the smallest factor κ on σ (0.5…4, steps of 1 %) with which the mean
over units of the 95 % intervals' coverage reaches 95 %, per period (ρ = 0: a factor alone).

    PYTHONPATH=src:. python studies/forward_factor.py /tmp/realnets purpleair antwerp gas
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import torch

from fedcal.algorithms.fedprior_choice_parts import subset
from fedcal.build import (
    build_algorithm,
    build_policy,
    build_task,
    client_inputs,
    engine_settings,
    load_configured,
    with_raw_column,
)
from fedcal.config import load_config
from fedcal.core.tree import expand
from fedcal.engine.simulation import EngineConfig, prepare, simulate

GRID = np.exp(np.linspace(np.log(0.5), np.log(4.0), 210))


def asked(e: np.ndarray, sd: np.ndarray, rows: np.ndarray) -> float:
    """The smallest κ of GRID whose mean over units of the coverage reaches 95 %."""
    ok = rows & np.isfinite(sd)
    z = np.abs(e) / np.where(ok, sd, 1.0)
    units = [i for i in range(len(z)) if ok[i].any()]
    cover = np.array([[(z[i][ok[i]] <= 1.959964 * k).mean() for k in GRID] for i in units])
    reach = cover.mean(0) >= 0.95
    return float(GRID[np.argmax(reach)]) if reach.any() else float("inf")


def periods(where: Path) -> dict[str, float]:
    config = load_config(where / "run.toml")
    fleet = load_configured(config, str(where / "network.csv"))
    tensors = prepare(fleet, config.data.scaling, config.engine.dtype)
    task = build_task(config, tensors.train.x.shape[-1], fleet.meta, client_inputs(tensors))
    alg = with_raw_column(build_algorithm("fedprior", config, task), config, tensors)
    alg = dataclasses.replace(alg, choice_interval="off")
    engine = EngineConfig(**engine_settings(config), seed=0, aggregation=build_policy(config)[0])
    res = simulate(alg, tensors, engine)
    train, test = tensors.train, tensors.test
    down = expand(alg.broadcast(res.server), train.num_clients)

    def scored(params, data):
        pred = alg.predict(params, data.x.double())[..., 0].double()
        sd = alg.predictive_std(params, data.x.double())[..., 0].double()
        return (pred - data.y[..., 0].double()).numpy(), sd.numpy()

    out = {}
    for k, (fit, rows) in enumerate(alg.time_choice.folds(train)):
        e, sd = scored(alg._personal(down, res.states, subset(train, fit)), train)
        out[f"fold {k}"] = asked(e, sd, rows.numpy() > 0)
    personal = alg.personalize(down, res.states, train)
    e, sd = scored(personal, test)
    out["future quarter"] = asked(e, sd, test.mask.numpy() > 0)
    return out


def main() -> None:
    torch.set_num_threads(1)
    root = Path(sys.argv[1])
    print("| network | κ asked: fold 0 | fold 1 | future quarter |\n|---|---|---|---|")
    for net in sys.argv[2:]:
        got = periods(root / net)
        print(f"| {net} | " + " | ".join(f"{v:.2f}" for v in got.values()) + " |", flush=True)


if __name__ == "__main__":
    main()
