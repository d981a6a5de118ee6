"""Review B of issue 34: a run says once when fedprior's time-respecting choice is off."""

from __future__ import annotations

from dataclasses import replace

from fedcal.build import choice_note
from fedcal.config import DataConfig, PrivacySection, RunConfig


def test_choice_note_names_why_and_the_unused_raw_column() -> None:
    data = DataConfig(features=("raw", "rh"), target="ref", raw_column="raw")
    cfg = RunConfig(data=data, methods=("fedprior", "fedavg"))
    assert (
        choice_note(cfg)
        == "choose=auto: off for fedprior (no time column); raw column 'raw' unused"
    )
    timed = replace(cfg, data=replace(data, time_column="time"))
    assert choice_note(timed) == ""  # the choice acts
    dp = replace(timed, privacy=PrivacySection(epsilon=1.0))
    assert choice_note(dp).startswith("choose=auto: off for fedprior (client-level DP)")
    stated = replace(cfg, method_params={"fedprior": {"choose": "off"}})
    assert choice_note(stated) == ""  # asked for: nothing to say
    assert choice_note(replace(cfg, methods=("fedavg",))) == ""  # no method has the choice
    chamber = replace(cfg, data=replace(data, raw_column=""))
    assert choice_note(chamber) == ""  # no time, no raw column: nothing given goes unused
