"""A federation mostly refused stops (issue 36.4): ``[engine] max_rejected_share``.

3 of 5 units scale their fedprior statistics ×1.5 (fedcal_support/prior_attack.py): the
server's consistency check refuses all three in every round. Before, the run finished on
the 2 honest units, exit 0, and nothing said that most of the federation was refused. Now
the first such round stops the run with one line, in the simulator and through the Flower
round loop; the share is a setting (1 = never), and 1 refused unit of 5 does not stop it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fedcal.apps.flower_server import build, federation
from fedcal.build import build_policy
from fedcal.config import EngineSection, RunConfig
from fedcal.engine.settings import FederationRefused, mostly_refused
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal_support.prior_attack import attacking, scale_arrays

ROUNDS = 3
PARAMS = {"fedprior": {"orders": [1, 1], "init_noise": 0.1}}


def _config(share: float) -> RunConfig:
    engine = EngineSection(rounds=ROUNDS, dtype="float64", max_rejected_share=share)
    return RunConfig(engine=engine, method_params=PARAMS)


def _simulate(fleet, attackers, share: float):
    config = _config(share)
    alg = attacking(build(config, "fedprior", 2), attackers, 1.5)
    policy = build_policy(config)[0]
    engine = EngineConfig(
        rounds=ROUNDS, seed=0, dtype="float64", aggregation=policy, max_rejected_share=share
    )
    return simulate(alg, prepare(fleet, dtype="float64"), engine)


def test_the_share_rule_itself() -> None:
    mostly_refused(0, 2, 4, 0.5)  # half is not more than half
    mostly_refused(0, 5, 5, 1.0)  # 1: never
    with pytest.raises(FederationRefused, match=r"^round 3: .* refused 3 of 5 units \(60%"):
        mostly_refused(2, 3, 5, 0.5)
    assert EngineSection().max_rejected_share == 0.5  # the default, documented


def test_the_simulator_stops_when_most_units_are_refused(make_fleet) -> None:
    fleet = make_fleet(num_clients=5, train=24)
    with pytest.raises(FederationRefused) as err:
        _simulate(fleet, [0, 2, 4], 0.5)
    assert str(err.value).startswith("round 1: the server's checks refused 3 of 5 units")
    assert "\n" not in str(err.value)
    # the same attack with the rule off runs to the end on the 2 honest units (as before)
    res = _simulate(fleet, [0, 2, 4], 1.0)
    refused = {r["client_index"] for r in res.extra["rejections"]}
    assert refused == {0, 2, 4}
    # one attacker of 5 is refused and the run goes on
    res = _simulate(fleet, [2], 0.5)
    assert {r["client_index"] for r in res.extra["rejections"]} == {2}


def test_a_flower_federation_of_five_sites_three_hostile_stops(make_fleet, tmp_path) -> None:
    pytest.importorskip("flwr")
    from flwr.app import Array, ArrayRecord, RecordDict

    from fedcal_support.flower_hostile import arrays, node_cfgs, run_in_process

    def hostile(t, i, part):
        if i not in (0, 2, 4) or "reply" not in part:
            return part
        out = RecordDict({k: v for k, v in part.items() if k != "reply"})
        scaled = scale_arrays(arrays(part), 1.5)
        out["reply"] = ArrayRecord({k: Array(np.asarray(v)) for k, v in scaled.items()})
        return out

    fleet = make_fleet(num_clients=5, train=24)
    fed = federation(_config(0.5), "fedprior", seed=0)
    with pytest.raises(FederationRefused) as err:
        run_in_process(fed, node_cfgs(fleet, tmp_path / "a"), run_id=5, tamper=hostile)
    assert str(err.value).startswith("round 1: the server's checks refused 3 of 5 units (60%")
    off = dataclasses.replace(federation(_config(1.0), "fedprior", seed=0))
    run_in_process(off, node_cfgs(fleet, tmp_path / "b"), run_id=5, tamper=hostile)
    named = {r["client"] for e in off.log for r in e.get("screening", [])}
    assert named == {0, 2, 4}  # before issue 36.4: this run finished, exit 0, silently


def test_a_round_whose_robust_step_can_judge_nobody_is_marked(make_fleet) -> None:
    """fedprior's robust M-step judges each unit against the others' moments, which needs
    more units than the basis's terms + 2 (here 4 terms: orders [1, 1]); with 5 units it
    judges nobody, and every round says so (aggregation.csv's ``unjudged``, the run's note
    and its summary row's ``unjudged_rounds``); with 12 it judges every round."""
    from fedcal.experiment import unjudged_note

    few = _simulate(make_fleet(num_clients=5, train=24), [], 0.5).extra["aggregation"]
    assert [r.get("unjudged") for r in few] == [1.0] * ROUNDS
    assert unjudged_note(few).startswith(f'{ROUNDS} robust = "full" judged nobody in 3 of 3')
    many = _simulate(make_fleet(num_clients=12, train=24), [], 0.5).extra["aggregation"]
    assert all("unjudged" not in r and "downweighted" in r for r in many)
    assert unjudged_note(many) == ""
