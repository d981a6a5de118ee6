"""FedPrior's parts built by one rule (fedprior_parts.declared) and its hooks as the parts'
methods (fedprior_parts.Delegate), as core/hooks.py's protocols see them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fedcal.algorithms.fedavg import FedAvg
from fedcal.algorithms.fedprior import FedPrior
from fedcal.algorithms.fedprior_declared import declared
from fedcal.algorithms.fedprior_parts import Delegate
from fedcal.core import hooks
from fedcal.core.task import Task
from fedcal.models.mlp import MLP


@dataclass(frozen=True)
class Part:
    holdout: float
    clip: float
    inputs: int


def test_a_field_is_given_then_the_prefixed_setting_then_the_setting_of_its_name():
    settings = {"holdout": "final", "choice_holdout": 0.25, "clip": 9.0, "inputs": 7}
    part = declared(Part, settings, {"inputs": 2}, prefix="choice_")
    assert part == Part(holdout=0.25, clip=9.0, inputs=2)
    assert declared(Part, settings, {}) == Part(holdout="final", clip=9.0, inputs=7)
    with pytest.raises(KeyError, match="clip"):  # a field that is no setting nor given
        declared(Part, {"holdout": 1.0}, {"inputs": 1})


def test_each_part_reads_the_settings_it_declares():
    alg = FedPrior(
        Task(MLP()),
        orders=(1, 1),
        choose="time",
        holdout="final",
        choice_holdout=0.3,
        select_patience=3,
        dp_max_rows=99.0,
        init_scale=2.0,
        interval="calibrated",
        choice_interval="off",
    )
    assert alg.time_choice.holdout == 0.3 and alg.rounds_schedule.holdout == "final"
    assert alg.rounds_schedule.select_patience == 0  # the time choice never freezes (R1)
    assert alg.private_statistics.max_rows == 99.0 and alg.private_statistics.init_scale == 2.0
    assert alg.time_choice.forward.interval == "off" and alg.calibrated.interval == "calibrated"
    assert alg.selection.terms == alg.terms == ((0, 0), (1, 0), (0, 1), (1, 1))
    assert alg.calibrated.basis is alg.design_basis is alg.time_choice.basis  # built once
    off = FedPrior(Task(MLP()), orders=(1, 1), choose="off", select_patience=3)
    assert off.rounds_schedule.select_patience == 3


def test_the_hooks_are_the_parts_methods_and_the_protocols_see_them():
    alg = FedPrior(Task(MLP()), orders=(1, 1))
    assert alg.finished == alg.rounds_schedule.finished
    assert alg.before_round == alg.rounds_schedule.before
    assert alg.dp_statistics == alg.private_statistics.checked
    assert alg.pick_inputs == alg.streamed.pick_inputs
    for protocol in (
        hooks.StreamsSums,
        hooks.EndsRounds,
        hooks.DeclaresStatistics,
        hooks.WeighsOutliers,
        hooks.UnitColumns,
        hooks.StatusValues,
        hooks.ReadsScaler,
        hooks.BindsConsistency,
        hooks.TimedStd,
        hooks.DerivesData,
    ):
        assert isinstance(alg, protocol), protocol.__name__
        assert not isinstance(FedAvg(Task(MLP())), protocol), protocol.__name__


def test_a_delegate_reads_the_part_through_the_owner_s_attribute():
    class Schedule:
        def finished(self) -> str:
            return "base"

    class Other:
        def finished(self) -> str:
            return "override"

    class Owner:
        schedule = Schedule()
        finished = Delegate("schedule")
        done = Delegate("schedule", "finished")

    class Sub(Owner):
        schedule = Other()  # a subclass's part is the one its hooks call

    assert Owner().finished() == Owner().done() == "base"
    assert Sub().finished() == "override"
    assert isinstance(Owner.__dict__["finished"], Delegate)  # (on the class: the descriptor)
