"""A calibrate output's deployed-σ terms (issue 36.3): an edited ``gp_*`` is refused.

``fedcal calibrate`` from a prior with a discrepancy model stores, per unit, what D2–D4
need (:func:`fedcal.algorithms.fedprior_deployed.deploy_shapes`): the design rows'
mask, the scale κ²s²(t/1.96)², a², β and ℓ. Each edited out of its range (its checksum
recomputed, so only the check can catch it) must make ``predict`` and every ``export``
refuse in one line naming the sensor and the field — before the check, ``predict``
served NaN or shifted σ and ``export --format c`` dropped σ silently.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from fedcal.core.tensorfile import load_trees
from fedcal.data.simulator import FleetSpec, simulate_fleet

from .test_hostile_rundir import assert_refused, invoke, model_edit, runner, snapshot

MODEL = "new/runs/fedprior_tp0_seed0/model.safetensors"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """``run/`` (fedprior, 4 reference units), ``new/`` (2 units of 6 points calibrated
    from it, D2–D4 in use), ``readings.csv`` (the new units' test rows)."""
    from fedcal.cli import app

    root = tmp_path_factory.mktemp("hostile_deployed")
    simulate_fleet(FleetSpec(num_sensors=4), seed=3).frame.to_csv(root / "fleet.csv", index=False)
    args = ["run", "--data", str(root / "fleet.csv"), "--methods", "fedprior", "--seeds", "1"]
    result = runner.invoke(app, [*args, "--out", str(root / "run"), "--quiet"])
    assert result.exit_code == 0, result.output
    new = simulate_fleet(FleetSpec(num_sensors=2, train_design="3x2"), seed=9).frame
    new = new.assign(sensor_id="NEW-" + new["sensor_id"])
    cols = ["sensor_id", "frequency_hz", "temperature_c"]
    new[[*cols, "pressure_hpa", "split"]].to_csv(root / "new_units.csv", index=False)
    new.query("split == 'test'")[cols].to_csv(root / "readings.csv", index=False)
    args = ["calibrate", "--prior", str(root / "run"), "--data", str(root / "new_units.csv")]
    result = runner.invoke(app, [*args, "--out", str(root / "new")])
    assert result.exit_code == 0, result.output
    (root / "fleet.csv").unlink()
    return root


def commands(case: Path) -> dict[str, list[str]]:
    new, out = str(case / "new"), case / "out"
    return {
        "predict": ["predict", new, "--data", str(case / "readings.csv"),
                    "--out", str(out / "cal.csv")],
        "export_c": ["export", new, "--format", "c", "--out", str(out / "m.h")],
        "export_json": ["export", new, "--format", "json", "--out", str(out / "m.json")],
    }  # fmt: skip


def _gp(name: str, value: float, first_only: bool = False):
    """Set ``name`` (every unit, or the first) to ``value``; the checksum recomputed."""

    def edit(params: dict, meta: dict) -> None:
        t = params[name].clone()
        (t[:1] if first_only else t).fill_(value)
        params[name] = t

    return model_edit(edit)


def _half_mask(params: dict, meta: dict) -> None:
    params["gp_mask"] = params["gp_mask"] * 0.5


EDITS = {
    "gp_amp=-1e-3 (one unit)": _gp("gp_amp", -1e-3, first_only=True),
    "gp_amp=1e300": _gp("gp_amp", 1e300),
    "gp_scale=-1": _gp("gp_scale", -1.0),
    "gp_scale=0": _gp("gp_scale", 0.0),
    "gp_beta=-1": _gp("gp_beta", -1.0),
    "gp_beta=0": _gp("gp_beta", 0.0),
    "gp_len=1e-300": _gp("gp_len", 1e-300),
    "gp_len=1e6": _gp("gp_len", 1e6),
    "gp_mask=0.5": model_edit(_half_mask),
}


def case_dir(pristine: Path, tmp_path: Path) -> Path:
    case = tmp_path / "case"
    shutil.copytree(pristine, case)
    (case / "out").mkdir()
    return case


def test_the_intact_output_serves_a_deployed_sigma(pristine, tmp_path):
    """Every command works on the untouched copy, with D2–D4 in use (a² > 0, s² ≠ 1): each
    refusal below is its edit's doing, and honest values pass the checks."""
    import pandas as pd

    params = load_trees(pristine / MODEL)[0]["params"]
    assert bool((params["gp_amp"] > 0).all()) and bool((params["gp_scale"] != 1).all())
    assert set(torch.unique(params["gp_mask"]).tolist()) <= {0.0, 1.0}
    case = case_dir(pristine, tmp_path)
    for name, args in commands(case).items():
        result, _ = invoke(args, limit=120)
        assert result.exit_code == 0, f"{name}: {result.output}"
    sd = pd.read_csv(case / "out" / "cal.csv")["pressure_hpa_std"]
    assert sd.notna().all() and bool((sd > 0).all())


@pytest.mark.parametrize("command", ["predict", "export_c", "export_json"])
@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_deployed_term_is_refused_by_predict_and_export(
    edit, command, pristine, tmp_path
):
    case = case_dir(pristine, tmp_path)
    EDITS[edit](case / MODEL)
    before = snapshot(case)
    args = commands(case)[command]
    result, _ = invoke(args)
    field = edit.split("=")[0]
    assert_refused(result, args, f"sensor 'NEW-S000': {field}:")
    assert "model.safetensors" in result.output
    assert snapshot(case) == before
