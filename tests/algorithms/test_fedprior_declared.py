"""A part built from what it declares (fedprior_declared.declared), and fedprior_drift's parts
built that way: each field is the setting it names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from fedcal.algorithms.fedprior_declared import declared, settings_of

from .test_fedprior_drift import make


@dataclass(frozen=True)
class Part:
    bins: int
    noise: str
    basis: object


def test_a_field_is_given_else_the_prefixed_setting_else_the_setting_of_its_name():
    settings = {"drift_bins": 6, "bins": 99, "noise": "sensor", "basis": "total"}
    got = declared(Part, settings, {"basis": "the design"}, prefix="drift_")
    assert got == Part(bins=6, noise="sensor", basis="the design")
    assert declared(Part, settings, {"basis": 1}) == Part(bins=99, noise="sensor", basis=1)


def test_a_field_that_is_neither_given_nor_a_setting_is_a_key_error_naming_it():
    with pytest.raises(KeyError, match="noise"):
        declared(Part, {"bins": 1}, {"basis": None})


def test_fedprior_drift_s_parts_hold_the_settings_they_name():
    """Each setting field of the walk, the short step and the fleet's drift is the
    algorithm's setting of its (prefixed) name, each set off its default so a swap would
    show; the rest are the parts they are built from."""
    alg = make(drift_bins=7, drift_holdout=0.3, drift_fit="evidence", drift_test=5.0)
    alg = dataclasses.replace(
        alg, short_emulation="span", short_sse_clip=11.0, noise="sensor", drift_score_clip=2.5
    )
    alg = dataclasses.replace(alg, drift_span_cap=9.0, recalibrate_ratio=3.0, min_informed=3.0)
    walk, short, fleet = alg.drift
    assert (walk.bins, walk.holdout, walk.noise) == (7, 0.3, "sensor")
    assert (walk.features, walk.phi_terms) == (alg.num_features, len(alg.terms))
    assert walk.basis is alg.design_basis and walk.support_box is alg.support_box
    assert (short.colocation, short.emulation, short.noise) == ("holdout", "span", "sensor")
    assert (short.drift_holdout, short.drift_test) == (0.3, 5.0)
    assert short.calibrated is alg.calibrated and short is alg.short
    assert (fleet.fit, fleet.prior, fleet.test) == ("evidence", "walk", 5.0)
    assert (fleet.score_clip, fleet.span_cap, fleet.short_sse_clip) == (2.5, 9.0, 11.0)
    assert (fleet.recalibrate_ratio, fleet.min_informed, fleet.noise) == (3.0, 3.0, "sensor")
    assert fleet.selection is alg.selection and fleet.short is short
    assert settings_of(alg)["drift_bins"] == 7
