"""prior.json's optional parts (the calibrated interval, the drift and its short class) are
checked by the schema: bad values are one-line errors naming the field, not a KeyError or a
torch message (fedcal.core.runfiles.check_prior)."""

from __future__ import annotations

import copy

import pytest

from fedcal.core.runfiles import RunFileError, check_prior

BASE = {
    "kind": "fedprior",
    "method": "fedprior_drift",
    "method_params": {},
    "features": ["x"],
    "target": "y",
    "terms": [[0], [1]],
    "mu": [0.0, 1.0],
    "sigma": [[1.0, 0.0], [0.0, 1.0]],
    "noise_var": 0.01,
    "scaler": {"x_offset": [0.0], "x_scale": [1.0], "y_offset": [0.0], "y_scale": [1.0]},
    "input_range": {"x": [0.0, 1.0]},
    "interval": {
        "rule": "calibrated",
        "discrepancy_var": float("nan"),
        "probe_rows": 8.0,
        "declined": 0,
        "weak_projector": [[0.0, 0.0], [0.0, 0.0]],
        "discrepancy_var_own": None,
    },
    "drift": {
        "q": 0.1,
        "time_scale": 2.0,
        "seen": [[1.0, 0.0], [0.0, 1.0]],
        "short": {"window": 0.1, "temper": 0.5, "q": 0.0, "tau": None, "held": 12.0},
    },
}


def test_a_valid_prior_with_interval_and_short_class_passes():
    assert check_prior("p.json", copy.deepcopy(BASE))["drift"]["short"]["temper"] == 0.5


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("drift", "short", "window"), None, "drift.short.window"),
        (("drift", "short", "tau"), -1.0, "drift.short.tau"),
        (("drift", "short", "temper"), 1.5, "drift.short.temper"),
        (("drift", "short", "held"), "12", "drift.short.held"),
        (("drift", "q"), float("inf"), "drift.q"),
        (("interval", "weak_projector"), [[0.0, "a"], [0.0, 0.0]], "interval.weak_projector"),
        (("interval", "declined"), 1.5, "interval.declined"),
    ],
)
def test_a_bad_optional_field_is_a_one_line_error_naming_it(path, value, field):
    doc = copy.deepcopy(BASE)
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(RunFileError, match=f"p.json: {field.replace('.', '[.]')}") as err:
        check_prior("p.json", doc)
    assert "\n" not in str(err.value)


def test_a_missing_short_key_names_it():
    doc = copy.deepcopy(BASE)
    del doc["drift"]["short"]["window"]
    with pytest.raises(RunFileError, match=r"drift\.short\.window"):
        check_prior("p.json", doc)
