"""Bitwise fingerprints of the fleet prior on small planted fleets: a refactor's equality check.

Each configuration (fedprior's noise, interval, selection, direction and time-choice variants;
fedprior_drift; its short co-location) runs 5 rounds, and each output is hashed (SHA-256 of
its float64 bytes, 16 hex digits): server state, personal models, client state, predictions,
σ, the interval, σ at each row's time, statuses, the implausible rule's values, the unit
columns and ``export_state``. Two trees give the same bits when the JSON files are equal:

    OMP_NUM_THREADS=1 PYTHONPATH=src:. python benchmarks/prior_fingerprints.py before.json
    (the same from the other tree, to after.json); diff before.json after.json

``--candidates`` adds four configurations of every candidate's EM (R1's sample and freeze,
the marginal scores, each unit's σ_ik², the selected direction term). ``--drift`` adds
fedprior_drift's variants (issue 35, fedprior_drift's split): the evidence fit, the static
prior, the time choice with and without the forward interval, BIC's candidates, sensor noise,
fixed bins, no robust weighting, the calibrated interval's own folds, no time column; each
also hashes the consistency check's verdicts on a round's replies with two forged units.

Run from the repository root (the planted fleets are the tests'). Used by issue 35.1's last
step (docs/design.md, "The flagship algorithms"); ~4 s on one thread. It reads only what
both sides of that step have (FedPrior's methods), so it runs on either.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from typing import Any

import torch

sys.path.insert(0, "tests")
from algorithms.test_fedprior import planted_fleet
from algorithms.test_fedprior_drift import make as make_drift
from algorithms.test_fedprior_drift import planted as planted_drift
from algorithms.test_fedprior_short import seasonal

from fedcal.algorithms.fedprior import FedPrior
from fedcal.algorithms.fedprior_drift import FedPriorDrift
from fedcal.core.task import Task
from fedcal.models.mlp import MLP
from fedcal_support.rounds import run_rounds

FEDPRIOR = {
    "plain": {},
    "bic_cal": {"select": "bic", "interval": "calibrated", "orders": (2, 1)},
    "cal_own": {"interval": "calibrated", "own_folds": 3, "probe_rows": 6},
    "time": {"choose": "time"},
    "time_bic": {"choose": "time", "select": "bic", "orders": (2, 1)},
    "time_cal_scale": {
        "choose": "time",
        "interval": "calibrated",
        "choice_sigma": "scale",
        "raw_input": 0,
        "raw_map": (0.1, 0.9),
    },
    "time_off_fwd": {"choose": "time", "choice_interval": "off", "noise": "sensor"},
    "branch": {"branch_orders": (1, 0), "interval": "calibrated"},
    "inputs_noise": {"noise_shape": "inputs", "interval": "calibrated"},
}
# every candidate's EM (fedprior_candidates): R1's sample and freeze, the marginal scores, the
# candidates with each unit's σ_ik² and the calibrated interval's residual terms, and with the
# direction term selected; run by ``--candidates`` (added after session 13's 16 configurations)
CANDIDATES = {
    "bic_sample_freeze": {
        "select": "bic",
        "orders": (2, 1),
        "select_units": 4,
        "select_patience": 2,
        "choose": "off",  # (the time-respecting choice never freezes the basis)
    },
    "bic_sample_time": {"select": "bic", "orders": (2, 1), "select_units": 4, "choose": "time"},
    "bic_marginal": {"select": "bic", "select_by": "marginal", "orders": (2, 1)},
    "bic_sensor_cal": {
        "select": "bic",
        "orders": (2, 1),
        "noise": "sensor",
        "interval": "calibrated",
    },
    "bic_branch": {
        "select": "bic",
        "orders": (2, 1),
        "branch_orders": (1, 0),
        "branch_select": True,
    },
}
DRIFT = {
    "drift": {},
    "drift_span": {"short_emulation": "span", "interval": "calibrated"},
    "drift_far_time": {"short_emulation": "far", "choose": "time"},
}
# fedprior_drift's variants (``--drift``), on the planted walk; ``make_drift`` fits the prior
# under the walk unless ``drift_prior = "static"``
DRIFT_VARIANTS = {
    "drift_evidence": {"drift_fit": "evidence"},
    "drift_static": {"drift_prior": "static"},
    "drift_static_evidence": {"drift_prior": "static", "drift_fit": "evidence"},
    "drift_time": {"choose": "time"},
    "drift_time_off": {"choose": "time", "choice_interval": "off"},
    "drift_choose_off": {"choose": "off"},
    "drift_bic": {"select": "bic", "degree": 2, "choose": "off"},
    "drift_bic_time": {"select": "bic", "degree": 2, "choose": "time"},
    "drift_sensor": {"noise": "sensor", "choose": "off"},
    "drift_bins": {"drift_bins": 6, "drift_holdout": 0.4},
    "drift_robust_off": {"robust": "off", "choose": "off"},
    "drift_cal_own": {"interval": "calibrated", "own_folds": 3, "short_colocation": "off"},
}
SHORT = {
    "short": {"choose": "off"},
    "short_time": {"choose": "time"},
    "short_span": {"choose": "off", "short_emulation": "span"},
    "short_far": {"choose": "time", "short_emulation": "far", "choice_sigma": "scale"},
}


def digest(tree: Any) -> str:
    """SHA-256 of a tree's keys and float64 bytes, 16 hex digits."""
    out = hashlib.sha256()

    def walk(t: Any, path: str = "") -> None:
        if isinstance(t, dict):
            for k in sorted(t):
                walk(t[k], f"{path}/{k}")
        elif isinstance(t, torch.Tensor):
            out.update(path.encode())
            out.update(t.detach().to(torch.float64).contiguous().numpy().tobytes())
        else:
            out.update(path.encode() + repr(t).encode())

    walk(tree)
    return out.hexdigest()[:16]


def digest_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def prints(alg: Any, train: Any, test: Any) -> dict[str, Any]:
    """5 rounds of ``alg`` on ``train``; every output's digest."""
    run = run_rounds(alg, train, 5)
    hook = getattr(alg, "unit_columns", None)  # (a hook on the base before session 13)
    columns = {} if hook is None else hook(run.personal, train)
    out = {"server": digest(run.server), "personal": digest(run.personal)}
    out["state"] = digest(run.states)
    out["predict"] = digest(alg.predict(run.personal, test.x))
    out["std"] = digest(alg.predictive_std(run.personal, test.x))
    out["halfwidth"] = digest(alg.interval_halfwidth(run.personal, test.x))
    out["timed"] = digest(alg.predictive_std_timed(run.personal, test))
    out["export"] = digest_json(alg.export_state(run.server))
    out["status"] = digest(alg.client_status(run.server, run.personal, test.x, test.mask))
    out["status_values"] = digest(alg.status_values(run.personal, test.x, test.mask))
    out["unit_columns"] = digest_json({k: list(map(float, v)) for k, v in columns.items()})
    out["note"] = alg.interval_note(run.server)
    out["noise_var"] = float(run.server["noise_var"])
    return out


def verdicts(alg: Any, train: Any) -> str:
    """The consistency check's verdicts (``inconsistent_replies``) on the replies of a round
    after 5, five units forged: an evidence grid raised, one lowered at q = 0, one raised at
    the broadcast q, a future score raised, a grid not finite."""
    from fedcal.core.tree import expand

    run = run_rounds(alg, train, 5)
    n = train.num_clients
    reply = alg.client_update(expand(alg.broadcast(run.server), n), run.states, train).reply
    grid = torch.cat([torch.zeros(1, dtype=torch.float64), torch.logspace(-3, 1, 33)])
    at = int(torch.argmin((grid - float(run.server["drift"]["q"])).abs()))
    reply["drift"]["loglik"][1] += 1e3
    reply["drift"]["loglik"][2, 0] -= 5.0
    reply["drift"]["loglik"][3, at] += 5.0
    reply["drift"]["future"][4] += 1e3
    reply["drift"]["loglik"][5, 3] = float("nan")
    accepted = torch.ones(n, dtype=torch.bool)
    return digest_json(alg.inconsistent_replies(run.server, reply, train.count, accepted))


def main(path: str, candidates: bool = False, drift: bool = False) -> None:
    found = {}
    train, test, *_ = planted_fleet(12, [6] * 4 + [20] * 8, seed=3, orders=(1, 1), noise=0.05)
    for name, settings in {**FEDPRIOR, **(CANDIDATES if candidates else {})}.items():
        found[name] = prints(FedPrior(Task(MLP()), **{"orders": (1, 1), **settings}), train, test)
    train, test = planted_drift(1.0, units=12, rows=20, future=10, seed=2)
    for name, settings in DRIFT.items():
        found[name] = prints(make_drift(**settings), train, test)
    for name, settings in (DRIFT_VARIANTS if drift else {}).items():
        alg = make_drift(**settings)
        found[name] = {**prints(alg, train, test), "verdicts": verdicts(alg, train)}
    if drift:  # no time column: q stays 0, fedprior's model (drift.note)
        untimed = (dataclasses.replace(train, time=None), dataclasses.replace(test, time=None))
        found["drift_untimed"] = prints(make_drift(), *untimed)
    train, test = seasonal()
    task = Task(MLP(in_features=1))
    for name, settings in SHORT.items():
        alg = FedPriorDrift(task, basis="total", degree=1, interval="calibrated", **settings)
        found[name] = prints(alg, train, test)
    with open(path, "w") as fh:
        json.dump(found, fh, indent=1, sort_keys=True)
    print(json.dumps({k: v["noise_var"] for k, v in found.items()}))


if __name__ == "__main__":
    main(sys.argv[1], "--candidates" in sys.argv[2:], "--drift" in sys.argv[2:])
