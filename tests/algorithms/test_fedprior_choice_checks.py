"""The server's bounds on fedprior_choice's uploads (review B of issue 34): one forged unit
cannot flip the fleet's basis by its scores, nor set the pooled line the others fall back to."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
import torch

from fedcal.algorithms.fedprior import FedPrior
from fedcal.algorithms.fedprior_choice_checks import choice_problems
from fedcal.apps.flower_server import build
from fedcal.build import build_policy
from fedcal.config import EngineSection, RunConfig
from fedcal.core.algorithm import ClientResult
from fedcal.core.bayes import F64
from fedcal.core.tree import expand, flatten
from fedcal.data.fleet import Fleet
from fedcal.engine.simulation import EngineConfig, prepare, simulate

from .test_fedprior_choice import curved_past, make

FORGER = 3
CFG = RunConfig(
    engine=EngineSection(rounds=8, dtype="float64"),
    method_params={"fedprior": {"basis": "total", "degree": 2, "select": "bic", "choose": "time"}},
)


def _fleet() -> Fleet:
    """16 units on one noisy line, 30 rows each, test rows after the calibration span."""
    rng = np.random.default_rng(1)
    rows = []
    for i in range(16):
        t, x = np.sort(rng.uniform(0, 1.3, 30)), rng.uniform(-1, 1, 30)
        y = x + 0.3 * rng.standard_normal(30)
        split = np.where(t < 1, "train", "test")
        rows += [
            dict(sensor_id=f"S{i:02d}", time=a, x=b, y=c, split=d)
            for a, b, c, d in zip(t, x, y, split, strict=True)
        ]
    return Fleet(pd.DataFrame(rows), ("x",), "y", "sensor_id", {"time_column": "time"})


@dataclasses.dataclass(frozen=True)
class Forger(FedPrior):
    forge: str = ""

    def client_update(self, down, state, data):
        out = super().client_update(down, state, data)
        if not self.forge or "choice" not in out.reply:
            return out
        c = {k: v.clone() for k, v in out.reply["choice"].items()}
        if self.forge == "score":  # "degree 0 is best by a million nats"
            c["score"][FORGER] = 0.0
            c["score"][FORGER, 0] = -1e6
        else:  # its all-rows line says y = 5 − 3x, with 1e6 rows' weight
            g = torch.eye(2, dtype=F64) * 1e6
            c["fit_rhs"][FORGER] = g @ torch.tensor([5.0, -3.0 / np.sqrt(3)], dtype=F64)
        return ClientResult({**out.reply, "choice": c}, out.state, out.metrics)


def _run(forge: str):
    base = build(CFG, "fedprior", 1)
    alg = Forger(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, forge=forge)
    eng = EngineConfig(rounds=8, seed=0, dtype="float64", aggregation=build_policy(CFG)[0])
    res = simulate(alg, prepare(_fleet(), dtype="float64"), eng)
    final = pd.DataFrame(res.final)
    honest = final[final.client_index != FORGER].test_rmse
    return alg, res, honest


@pytest.mark.parametrize("forge", ["score", "pooled"])
def test_a_forged_unit_moves_neither_the_basis_nor_the_pooled_line(forge) -> None:
    _, clean, honest = _run("")
    _, res, forged = _run(forge)
    assert int(res.server["choice"]) == int(clean.server["choice"])
    # the forger's rounds are refused (it only loses its own weight in the prior): the
    # pooled line stays the fleet's, well inside its row noise 0.3/√(16·23) ≈ 0.016 per term
    assert torch.allclose(res.server["pooled_all"], clean.server["pooled_all"], atol=0.02)
    reasons = {r["reason"] for r in res.extra["rejections"] if r["client_index"] == FORGER}
    assert reasons and all("choice" in r for r in reasons)
    assert res.personal["fallback"].sum() == clean.personal["fallback"].sum()
    assert abs(forged.mean() - honest.mean()) < 0.02 * honest.mean()


def _uploads():
    train, _ = curved_past(units=5, rows=30)
    alg = make(select="bic")
    down = expand(alg.broadcast(alg.server_init({})), 5)
    state = alg.client_init(down)
    out = alg.client_update(down, state, train)  # round 0: no pooled line, no choice yet
    down = expand(alg.broadcast(alg.server_update(alg.server_init({}), out.reply, train.count)), 5)
    reply = alg.client_update(down, out.state, train).reply
    return alg, flatten(reply)


def test_honest_choice_uploads_pass_and_each_forgery_is_named() -> None:
    alg, sub = _uploads()
    lin = torch.tensor(alg.time_choice.linear_terms)
    assert choice_problems(sub, alg.choice_clip, lin) == {}
    cases = {
        "choice/score": (lambda v: v.__setitem__((1, 0), -1e6), "outside [0, 5]"),
        "choice/scored": (lambda v: v.__setitem__(1, 2.0), "scored not 0/1"),
        "choice/lin_rhs": (lambda v: v.__setitem__((1, 0, 0), float("nan")), "not finite"),
        "choice/lin_gram": (lambda v: v.__setitem__((1, 0, 0, 0), 1e6), "fold rows"),
        "choice/fit_rhs": (lambda v: v.__setitem__((1, 0), v[1, 0] * (1 + 1e-6)), "fit_rhs"),
    }
    for key, (forge, why) in cases.items():
        bad = {k: v.clone() for k, v in sub.items()}
        forge(bad[key])
        found = choice_problems(bad, alg.choice_clip, lin)
        assert list(found) == [1] and why in found[1], key


def test_the_server_clips_each_units_score_without_the_check() -> None:
    alg, sub = _uploads()
    choice = {k.split("/", 1)[1]: v for k, v in sub.items() if k.startswith("choice/")}
    forged = {k: v.clone() for k, v in choice.items()}
    forged["score"][1] = -1e6
    forged["score"][2] = 1e6
    forged["scored"][3] = 7.0
    out = alg.time_choice.update(forged, torch.arange(5), sub["gram"], True)
    clipped = choice["score"].clone()
    clipped[1], clipped[2] = 0.0, alg.choice_clip
    assert torch.allclose(out["forward_scores"], clipped.sum(0))
    assert float(out["forward_scored"]) == float(choice["scored"].sum())
