"""Same numbers through issue 35's refactor (FedPrior's mixins → parts with declared state).

Each case runs a few rounds of the fleet prior on a small planted fleet and compares a few
figures with those the code printed before the refactor (commit 0aa5565, the mixin
FedPrior): the fleet noise σ², μ's first two coefficients, two units' prediction and
predictive σ at their first test row, the chosen candidate. The refactor only moves code,
so the numbers are the same to the last bit on one machine and thread count; the tolerance,
1e-12 relative, leaves room for BLAS's thread-dependent rounding (fedprior_drift's σ(t)
differs by 3e-15 between one thread and the default) and a change of summation order (none
was made: the bitwise runs are in the report of issue 35 part 1). A change of model (a new
default, a fix) must update these figures in the same commit, saying why.
"""

from __future__ import annotations

import pytest
import torch

from fedcal.algorithms.fedprior import FedPrior
from fedcal.core.task import Task
from fedcal.models.mlp import MLP
from fedcal_support.rounds import run_rounds

from .test_fedprior import planted_fleet
from .test_fedprior_drift import make as make_drift
from .test_fedprior_drift import planted as planted_drift

REL = 1e-12

# (settings, σ², μ[:2], ŷ of units 0 and 1 at their first test row, σ there, choice)
BEFORE = {
    "plain": (
        {},
        0.0022708655852957966,
        [0.5109377182756702, 0.20367056543875003],
        [-1.1587767698722522, 0.2772482837981548],
        [0.06413213856171497, 0.056945951401680205],
        -1,
    ),
    "bic_calibrated": (
        {"select": "bic", "interval": "calibrated", "orders": (2, 1)},
        0.002235025795928858,
        [0.5108889170889127, 0.2036624580114334],
        [-1.1587671950334415, 0.27705034966460995],
        [0.06362582012837018, 0.05649943544063338],
        4,
    ),
    "sensor_student": (
        {"noise": "sensor", "noise_tail": "student"},
        0.002628956946114579,
        [0.5106988173281551, 0.2032262898195873],
        [-1.1587721721752013, 0.277666036175883],
        [0.06704323097737074, 0.0648449646013763],
        -1,
    ),
}


@pytest.mark.parametrize("case", sorted(BEFORE))
def test_fedprior_gives_the_numbers_of_the_mixin_class(case):
    settings, noise, mu, pred, std, choice = BEFORE[case]
    train, test, *_ = planted_fleet(12, [6] * 4 + [20] * 8, seed=3, orders=(1, 1), noise=0.05)
    alg = FedPrior(Task(MLP()), **{"orders": (1, 1), **settings})
    run = run_rounds(alg, train, 4)
    assert float(run.server["noise_var"]) == pytest.approx(noise, rel=REL)
    assert run.server["mu"][:2].tolist() == pytest.approx(mu, rel=REL)
    got = alg.predict(run.personal, test.x)[:2, 0, 0].tolist()
    assert got == pytest.approx(pred, rel=REL)
    got = alg.predictive_std(run.personal, test.x)[:2, 0, 0].tolist()
    assert got == pytest.approx(std, rel=REL)
    assert int(run.server.get("choice", torch.tensor(-1))) == choice


def test_fedprior_drift_gives_the_numbers_of_the_mixin_class():
    """fedprior_drift (with its short co-location step) on a planted walk: σ², the fleet's
    walk q, two units' prediction and σ at the time of their first future row."""
    train, test = planted_drift(1.0, units=12, rows=20, future=10, seed=2)
    alg = make_drift()
    run = run_rounds(alg, train, 4)
    assert float(run.server["noise_var"]) == pytest.approx(0.011995554404771146, rel=REL)
    assert float(run.server["drift"]["q"]) == pytest.approx(0.4216965034285822, rel=REL)
    got = alg.predict(run.personal, test.x)[:2, 0, 0].tolist()
    assert got == pytest.approx([0.9712935543752158, -1.118442990465614], rel=REL)
    got = alg.predictive_std_timed(run.personal, test)[:2, 0, 0].tolist()
    # σ(t) after fieldcov's forward interval (issue 34, main 2f22e33): 0.2304, 0.1452 before
    assert got == pytest.approx([0.22780610728741557, 0.14151750337952923], rel=REL)


# issue 35.1's last mixins (compose2): figures printed by main ea37ee4, where the calibrated
# interval, the time-respecting choice and its forward interval were still mixins; this
# branch gives the same bits (the report's fingerprints of 16 configurations).
TIMED = {
    "time_bic": (
        {"choose": "time", "select": "bic", "orders": (2, 1)},
        0.002270865585295792,
        [0.06413213856171492, 0.05694595140168013],
        [3.3617223550813757, 4.115734312589602],  # the forward scores of candidates 4, 5
        (0.8502490810665366, 0.0006976744186046512),  # κ, ρ/T after calibration
        [0.011852854576082438, 0.0016096076120970901],  # units 0, 1's validation MSE
    ),
    "time_calibrated_own": (
        {
            "choose": "time",
            "interval": "calibrated",
            "own_folds": 3,
            "probe_rows": 6,
            "choice_sigma": "scale",
        },
        0.002235025795929171,
        [0.06362582012837463, 0.05649943544063729],
        [50.35157141228322, 58.485872115210405],
        (1.0607659583708762, 6.976744186046511e-05),
        [0.011882651626427529, 0.0016367324059662707],
    ),
}


@pytest.mark.parametrize("case", sorted(TIMED))
def test_the_time_choice_gives_the_numbers_of_the_mixin_class(case):
    """Row order as time (``choose = "time"``): the fleet σ², two units' σ, the summed
    forward scores, the fleet's factor and rate after calibration, two units' validation MSE
    (with ``choice_sigma = "scale"`` the σ factor of every unit)."""
    settings, noise, std, scores, forward, val = TIMED[case]
    train, test, *_ = planted_fleet(12, [6] * 4 + [20] * 8, seed=3, orders=(1, 1), noise=0.05)
    alg = FedPrior(Task(MLP()), **{"orders": (1, 1), **settings})
    run = run_rounds(alg, train, 4)
    assert float(run.server["noise_var"]) == pytest.approx(noise, rel=REL)
    got = alg.predictive_std(run.personal, test.x)[:2, 0, 0].tolist()
    assert got == pytest.approx(std, rel=REL)
    cand = 4 if case == "time_bic" else 1
    got = run.server["forward_scores"][cand : cand + 2].tolist()
    assert got == pytest.approx(scores, rel=REL)
    got = (float(run.server["fwd_scale"]), float(run.server["fwd_rate"]))
    assert got == pytest.approx(forward, rel=REL)
    assert run.personal["val_mse"][:2].tolist() == pytest.approx(val, rel=REL)
    assert run.personal["fallback"].tolist() == [0.0] * 12  # every unit keeps its model
