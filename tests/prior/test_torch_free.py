"""Issue 37.1: what a calibration station runs, with torch not importable.

Each check runs in a child process whose ``sys.meta_path`` refuses ``torch`` (any import of
it, direct or through a fedcal module, raises ImportError). Covered: the command line's
``--help``/``--version`` (and that they load no torch, pandas or scipy); the station's
numbers (:func:`fedcal.prior.station.calibrate_fleet`) equal to the same calls here; the
production line's commands, ``calibrate`` → ``predict`` → ``export`` (C, JSON) →
``certificate`` → ``report``, for fedprior and its variants fedprior_branch, fedprior_fixed and
fedprior_sensor: their outputs against the torch path's (tolerances in
:func:`test_the_station_commands_run_without_torch`); and ``plan`` (a design, sequential
mode) of the same priors against the torch path's forecast
(:func:`test_plan_runs_without_torch_and_equals_the_torch_path`). ``run`` and a variant the
NumPy path does not cover (``calibrate``, ``plan``) say in one line that they need
``fedcal[neural]``.

CI (.ci/run) also runs this file in a clean environment built from the wheel, where torch is
not installed: the prior is trained beforehand with the full environment
(``python tests/prior/test_torch_free.py DIR``) and named by ``FEDCAL_STATION_DIR``; the
tests that need torch here are skipped there.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from fedcal.cli import app
from fedcal.data.loader import load_fleet
from fedcal.data.simulator import FleetSpec, simulate_fleet
from fedcal.prior import posterior, station
from fedcal.prior.find import find_prior
from fedcal.prior.model import PriorModel
from fedcal.report.served import torch_available

runner = CliRunner(env={"COLUMNS": "200"})
COLS = ["sensor_id", "frequency_hz", "temperature_c", "pressure_hpa", "split"]
METHODS = ("fedprior", "fedprior_branch", "fedprior_fixed", "fedprior_sensor")
needs_torch = pytest.mark.skipif(not torch_available(), reason="compares with the torch path")

BLOCK = """
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)  # as if absent
        return None

sys.meta_path.insert(0, NoTorch())
"""

STATION = """
import json, sys
import numpy as np
from fedcal.data.loader import load_fleet
from fedcal.prior import posterior, station
from fedcal.prior.model import PriorModel

prior = PriorModel.load(sys.argv[1])
fleet = load_fleet(sys.argv[2], prior.features, prior.target, test_fraction=0.0,
                   min_train_points=1, min_test_points=0)
done = station.calibrate_fleet(prior, fleet, sys.argv[2])
units = done.units
x, _, _, _ = posterior.padded_rows(prior, fleet, "test")
one = done.predict(done.ids[0], fleet.arrays("test")[0][0])
np.savez(sys.argv[3], coef=units.coef, cov=units.cov, noise=units.noise_var,
         one_mean=one[0], one_std=one[1],
         d2=done.checks["d2"], status=done.status.astype(str),
         pred=posterior.predict(units, x), std=posterior.predictive_std(units, x))
print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))))
"""

# The torch path as the reference, where torch is installed: since the commands calibrate
# and serve a covered prior in NumPy whether or not torch is there (fedcal.calibrated,
# fedcal.report.export.load_models), the reference child refuses the NumPy path to both:
# calibrate takes FedPrior's posterior (fedcal.calibration), predict/export/certificate
# evaluate the stored units with FedPrior (load_models' torch branch).
TORCH_PATH = """
import fedcal.prior.posterior as _posterior, fedcal.report.served as _served
_posterior.unsupported = lambda prior, timed=False: "the reference: FedPrior's path"
def _refuse(*args, **kwargs):
    raise _served.NeedsTorch("the reference: FedPrior's evaluation")
_served.load_station = _refuse
"""

CLI = (
    "from fedcal.cli import app\n"
    "try:\n    app(sys.argv[1:])\nfinally:\n"
    "    print('TORCH', any(m.split('.')[0] == 'torch' for m in sys.modules), file=sys.stderr)\n"
)


def _child(code: str, *args: str, block: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-c", (BLOCK if block else "import sys\n") + code, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_the_blocker_blocks():
    res = _child("import torch")
    assert res.returncode != 0 and "No module named 'torch'" in res.stderr


@pytest.mark.parametrize("args", [["--help"], ["calibrate", "--help"], ["--version"]])
def test_help_and_version_need_no_torch_and_load_no_heavy_module(args):
    code = (
        "from fedcal.cli import app\n"
        "try:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
        "heavy = [m for m in ('torch', 'pandas', 'scipy') if m in sys.modules]\n"
        "print('HEAVY', heavy, 'EXIT', code)\n"
    )
    res = _child(code, *args)
    assert res.returncode == 0, res.stderr
    assert "HEAVY [] EXIT 0" in res.stdout, res.stdout[-500:]


def make_prior(root: Path) -> None:
    """A fedprior run (:data:`METHODS`) on 12 reference units + 4 with a 3x2 design in
    ``root/fleet_run``; 3 new 3x2 units with held-out test rows in ``root/new_units.csv``.
    Trains with the engine: needs torch (CI runs it with the full environment)."""
    root.mkdir(parents=True, exist_ok=True)
    fleet_file = root / "fleet.csv"
    spec = FleetSpec(num_reference=12, num_new=4, train_design="3x2")
    simulate_fleet(spec, seed=3).frame.to_csv(fleet_file, index=False)
    cfg = root / "prior.toml"
    cfg.write_text("[engine]\nrounds = 20\neval_every = 20\n")
    args = ["run", "--data", str(fleet_file), "--methods", ",".join(METHODS), "--seeds", "1"]
    result = runner.invoke(app, [*args, "--config", str(cfg), "--out", str(root / "fleet_run")])
    assert result.exit_code == 0, result.output
    new = simulate_fleet(FleetSpec(num_sensors=3, train_design="3x2", test_design="random"), 9)
    frame = new.frame.assign(sensor_id="NEW-" + new.frame["sensor_id"])
    frame[COLS].to_csv(root / "new_units.csv", index=False)


def station_root(tmp_path_factory, name: str, build) -> Path:
    """The folder of the trained priors: CI's (``FEDCAL_STATION_DIR``, trained by the full
    environment: module docstring), else a new one ``build`` trains (needs torch)."""
    given = os.environ.get("FEDCAL_STATION_DIR")
    if given:
        return Path(given)
    pytest.importorskip("torch", reason="training the prior needs torch")
    root = tmp_path_factory.mktemp(name)
    build(root)
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(prior.json of fedprior, the new units' file, a scratch folder, the run folder)."""
    root = station_root(tmp_path_factory, "torch_free", make_prior)
    scratch = tmp_path_factory.mktemp("station")
    run = root / "fleet_run"
    return find_prior(run), root / "new_units.csv", scratch, run


def test_the_station_calibrates_and_predicts_without_torch(trained):
    prior_file, new_file, root, _ = trained
    res = _child(STATION, str(prior_file), str(new_file), str(root / "child.npz"))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []  # no torch module loaded
    child = np.load(root / "child.npz")
    prior = PriorModel.load(prior_file)  # the same calls here, torch importable
    fleet = load_fleet(
        new_file, prior.features, prior.target, test_fraction=0.0, min_train_points=1,
        min_test_points=0,
    )  # fmt: skip
    done = station.calibrate_fleet(prior, fleet)
    units = done.units
    x = posterior.padded_rows(prior, fleet, "test")[0]
    here = {
        "coef": units.coef, "cov": units.cov, "noise": units.noise_var,
        "d2": done.checks["d2"], "status": done.status.astype(str),
        "one_mean": done.predict(done.ids[0], fleet.arrays("test")[0][0])[0],
        "one_std": done.predict(done.ids[0], fleet.arrays("test")[0][0])[1],
        "pred": posterior.predict(units, x), "std": posterior.predictive_std(units, x),
    }  # fmt: skip
    for key, value in here.items():  # the same code on the same inputs: the same bits
        np.testing.assert_array_equal(child[key], value, err_msg=key)
    assert np.isfinite(child["std"]).any() and child["coef"].shape[0] == 3


def test_the_station_s_values_are_fedcal_predict_s_after_fedcal_calibrate(trained, monkeypatch):
    """The torch-free values of one unit's held-out readings against the commands
    ``fedcal calibrate`` then ``fedcal predict`` — its <target>_calibrated and _std columns,
    to 1e-10 relative (fleet noise: tests/prior/test_posterior.py's derivation); where torch
    is installed, the commands on FedPrior's path (:data:`TORCH_PATH`'s patches)."""
    prior_file, new_file, root, _ = trained
    if torch_available():  # the reference: FedPrior's calibrate and evaluation
        from fedcal.report import served as served_module

        def refuse(*args, **kwargs):
            raise served_module.NeedsTorch("the reference: FedPrior's evaluation")

        monkeypatch.setattr(posterior, "unsupported", lambda prior, timed=False: "reference")
        monkeypatch.setattr(served_module, "load_station", refuse)
    res = _child(STATION, str(prior_file), str(new_file), str(root / "child2.npz"))
    assert res.returncode == 0, res.stderr
    child = np.load(root / "child2.npz")
    out = root / "calibrated"
    args = ["calibrate", "--prior", str(prior_file), "--data", str(new_file), "--out", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    prior = PriorModel.load(prior_file)
    frame = pd.read_csv(new_file)
    first = frame[(frame["sensor_id"] == frame["sensor_id"].iloc[0]) & (frame["split"] == "test")]
    readings = root / "readings.csv"
    first[["sensor_id", *prior.features]].to_csv(readings, index=False)
    served = root / "served.csv"
    args = ["predict", str(out), "--data", str(readings), "--out", str(served)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    table = pd.read_csv(served)
    for ours, column in (("one_mean", "_calibrated"), ("one_std", "_std")):
        theirs = table[prior.target + column].to_numpy()
        scale = np.abs(theirs).max()
        assert np.abs(child[ours] - theirs).max() <= 1e-10 * scale, column


def test_report_of_a_calibrate_output_runs_without_torch(trained):
    """``fedcal report OUT`` of a calibrate output (its units table and QA findings): the
    same output with torch blocked as without."""
    prior_file, new_file, root, _ = trained
    out = root / "for_report"
    args = ["calibrate", "--prior", str(prior_file), "--data", str(new_file), "--out", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    code = "from fedcal.cli import app\napp(sys.argv[1:])\n"
    blocked = _child(code, "report", str(out))
    normal = _child(code, "report", str(out), block=False)
    assert blocked.returncode == 0, blocked.stderr
    assert normal.returncode == 0 and blocked.stdout == normal.stdout
    assert "NEW-S000" in blocked.stdout and "QA" in blocked.stdout


def test_a_command_that_still_needs_torch_says_so_in_one_line(trained):
    _, new_file, root, _ = trained
    args = ["run", "--data", str(new_file), "--methods", "fedprior", "--out", str(root / "r")]
    res = _child("from fedcal.cli import app\napp(sys.argv[1:])\n", *args)
    assert res.returncode == 3, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs torch, which is not installed" in lines[0], lines
    assert "pip install 'fedcal[neural]'" in lines[0]


def test_a_variant_the_numpy_path_does_not_cover_is_refused_in_one_line(trained):
    prior_file, new_file, root, _ = trained
    doc = json.loads(Path(prior_file).read_text())
    prior = PriorModel.from_dict({**doc, "noise_gamma": [0.1, 0.0]})
    fleet = load_fleet(new_file, prior.features, prior.target, test_fraction=0.0)
    with pytest.raises(ValueError, match=r"^new\.csv: noise over the inputs .* torch path"):
        station.calibrate_fleet(prior, fleet, "new.csv")
    shaped = root / "shaped_prior.json"
    prior.save(shaped)  # calibrate without torch: one line naming the variant and the extra
    args = ["calibrate", "--prior", str(shaped), "--data", str(new_file)]
    res = _child("from fedcal.cli import app\napp(sys.argv[1:])\n", *args, "--out", str(root / "s"))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 3 and len(lines) == 1, res.stderr
    assert "noise over the inputs" in lines[0] and "fedcal[neural]" in lines[0]
    # plan of that prior: the same one line (its forecast is calibrate's torch path)
    args = ["plan", "--prior", str(shaped), "--plateaus", "2", "--points", "6"]
    res = _child("from fedcal.cli import app\napp(sys.argv[1:])\n", *args)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 3 and len(lines) == 1, res.stderr
    assert "plan of noise over the inputs" in lines[0] and "fedcal[neural]" in lines[0]


# ---- the production line's commands: calibrate → predict → export → certificate → report ----
CHAIN = """
import json
from fedcal.cli import app
codes = []
for args in json.loads(sys.argv[1]):
    try:
        app(args)
    except SystemExit as e:
        codes.append(e.code or 0)
print("CODES", json.dumps(codes))
print("TORCH", any(m.split(".")[0] == "torch" for m in sys.modules))
"""
# Tolerances (derived). Calibrating: the NumPy and torch posteriors solve the same system
# differently; they agree to the solves' backward error p·ε·κ(A) < 1e-10 relative
# (tests/prior/test_posterior.py measures κ(A) and asserts that bound), so every value in the
# target's unit agrees to 1e-10 × the target's scale (the largest |target| calibrated);
# d² and its p-value to 1e-8 relative (test_posterior.py's), and with per-unit noise
# (fedprior_sensor) to its fixed point's bound, 2e-6. Serving one stored model: both paths
# evaluate the same numbers by the same formulas (no solve): ≲ p²ε ≈ 1e-13 of the scale,
# asserted at 1e-12; the exports and certificates write them rounded: byte-equal.
SOLVE_TOL, SERVE_TOL = 1e-10, 1e-12
# d² is one function on both paths (fedcal.prior.qa.distances; the torch path hands it its
# design): measured equal to the bit for fedprior, fedprior_branch and fedprior_fixed (was
# 1.5e-8 for fedprior_branch with two solvers: its pinned ψ coordinates make C_i
# ill-conditioned). 1e-8 stays the bound for inputs (design, σ²) that agree within rounding;
# fedprior_sensor's σ_i² is its fixed point's, 2e-6.
DISTANCE_TOL = {"fedprior_sensor": 2e-6}
RELATIVE = ("d2", "p_value")


def _chain(method: str, root: Path, tag: str, readings: Path, calibrate: bool) -> list:
    out = root / f"{tag}_{method}"
    src = root / f"np_{method}"  # every chain serves the torch-free calibrate's output
    args = [
        ["predict", str(src), "--data", str(readings), "--out", f"{out}_pred.csv"],
        ["export", str(src), "--format", "c", "--out", f"{out}.h"],
        ["export", str(src), "--format", "json", "--out", f"{out}.json"],
        ["certificate", str(src), "--out", f"{out}_cert", "--issued", "2026-01-02"],
        ["report", str(src)],
    ]
    return [["calibrate", "--method", method, "--out", str(out)], *args] if calibrate else args


def _close(a: pd.DataFrame, b: pd.DataFrame, where: str, scale: float, method: str) -> None:
    assert list(a.columns) == list(b.columns) and len(a) == len(b), where
    for col in a.columns:
        x, y = a[col], b[col]
        if x.dtype.kind != "f" or y.dtype.kind != "f":
            assert (x.astype(str) == y.astype(str)).all(), f"{where}: {col}"
            continue
        assert (x.isna() == y.isna()).all(), f"{where}: {col} NaN"
        if col in RELATIVE:
            tol, ref = DISTANCE_TOL.get(method, 1e-8), np.abs(y)
        elif col == "coverage95" or col.startswith(("test_coverage", "coverage95")):
            tol, ref = 0.0, np.abs(y)  # a fraction of rows inside: equal (module comment)
        else:
            tol, ref = SOLVE_TOL, scale
        gap = np.abs(x - y).to_numpy()
        bad = np.nan_to_num(gap - tol * ref, nan=0.0) > 0
        assert not bad.any(), (
            f"{method} {where}: {col}: {np.nanmax(gap):.3g} > {tol:g} × scale; "
            f"{x[bad].tolist()} vs {y[bad].tolist()}"
        )


def _compare_calibrated(ours: Path, torch_out: Path, method: str, scale: float) -> None:
    """The torch-free calibrate output against the torch path's (tolerances above)."""
    from fedcal.core.arrayfile import load_arrays

    names = sorted(p.relative_to(torch_out) for p in torch_out.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(ours) for p in ours.rglob("*") if p.is_file())
    for name in names:
        a, b = ours / name, torch_out / name
        if name.suffix == ".csv":
            _close(pd.read_csv(a), pd.read_csv(b), str(name), scale, method)
        elif name.suffix == ".safetensors":
            (ta, ma, _), (tb, mb, _) = load_arrays(a), load_arrays(b)
            assert ma == mb and list(ta["params"]) == list(tb["params"]), name
            for k, v in tb["params"].items():
                ref = scale / abs(ma["scaler"]["y_scale"][0])  # scaled units
                assert np.abs(ta["params"][k] - v).max() <= SOLVE_TOL * ref, (name, k)
        else:  # config.json, prior.json, valid_range.json
            assert a.read_bytes() == b.read_bytes(), name


def test_the_station_commands_run_without_torch(trained):
    """With torch blocked: calibrate → predict → export c, json → certificate → report for
    each of :data:`METHODS`, no torch module loaded, every exit 0. Against the torch path
    (where torch is installed): the calibrate output within the derived tolerances
    (config.json, prior.json, valid_range.json byte-equal), and the same output served by
    the torch path — predictions to 1e-12 of the scale, C header, JSON and certificates
    byte-equal (report's console: test_report_of_a_calibrate_output_runs_without_torch)."""
    _, new_file, root, run = trained
    frame = pd.read_csv(new_file)
    readings = root / "readings.csv"
    frame[frame["split"] == "test"][COLS[:3]].to_csv(readings, index=False)
    scale = float(frame.loc[frame["split"] == "train", "pressure_hpa"].abs().max())
    base = ["--prior", str(run), "--data", str(new_file)]
    blocked = [
        [*cmd[:1], *base, *cmd[1:]] if cmd[0] == "calibrate" else cmd
        for m in METHODS
        for cmd in _chain(m, root, "np", readings, calibrate=True)
    ]
    res = _child(CHAIN, json.dumps(blocked))
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"CODES {json.dumps([0] * len(blocked))}" in res.stdout, res.stdout[-2000:]
    assert "TORCH False" in res.stdout
    for m in METHODS:
        assert (root / f"np_{m}_cert" / "NEW-S000.pdf").stat().st_size > 0
    if not torch_available():
        return  # the core environment: nothing to compare with (module docstring)
    served = [cmd for m in METHODS for cmd in _chain(m, root, "t", readings, calibrate=False)]
    torch_cal = [[*cmd[:1], *base, *cmd[1:]] for m in METHODS for cmd in
                 [["calibrate", "--method", m, "--out", str(root / f"torch_{m}")]]]  # fmt: skip
    ref = _child(TORCH_PATH + CHAIN, json.dumps(torch_cal + served), block=False)
    assert f"CODES {json.dumps([0] * (len(torch_cal) + len(served)))}" in ref.stdout, ref.stderr
    assert "TORCH True" in ref.stdout
    for m in METHODS:
        _compare_calibrated(root / f"np_{m}", root / f"torch_{m}", m, scale)
        ours, theirs = pd.read_csv(root / f"np_{m}_pred.csv"), pd.read_csv(root / f"t_{m}_pred.csv")
        for col in ours.columns:
            if ours[col].dtype.kind == "f":
                gap = np.nanmax(np.abs(ours[col] - theirs[col]))
                assert gap <= SERVE_TOL * scale, (m, col, gap)
            else:
                assert (ours[col] == theirs[col]).all(), (m, col)
        for suffix in (".h", ".json"):
            assert (root / f"np_{m}{suffix}").read_bytes() == (root / f"t_{m}{suffix}").read_bytes()
        for page in sorted((root / f"t_{m}_cert").glob("*.html")):
            assert (root / f"np_{m}_cert" / page.name).read_bytes() == page.read_bytes(), page


# ---- plan: the design search and its forecast in NumPy ----------------------------------
def _half_unit(text: str) -> float:
    """Half a unit of the last printed digit ("0.08459" → 5e-6)."""
    return 0.5 * 10.0 ** Decimal(text).as_tuple().exponent


def _printed(stdout: str) -> tuple[dict, list]:
    """(the plan table's "planned" row by column, the --next lines' (P, T, dir, σ) texts)."""
    lines = [line.split() for line in stdout.splitlines()]
    names = next((words for words in lines if words[:1] == ["design"]), [])
    row = next((words for words in lines if words[:1] == ["planned"]), [])
    steps = re.findall(r"next: (\S+) hPa at (\S+) °C, (\w+): RMS σ → (\S+)", stdout)
    return dict(zip(names, row, strict=True)), steps


API_PLAN = """
from fedcal.api import FleetPrior
FleetPrior.load(sys.argv[1]).plan(2, 6).design.frame().to_csv(sys.argv[2], index=False)
print("TORCH", any(m.split(".")[0] == "torch" for m in sys.modules))
"""


def _plan_args(run: Path, method: str, out: Path, unit: Path) -> list[list[str]]:
    base = ["plan", "--prior", str(run), "--method", method]
    return [
        [*base, "--plateaus", "2", "--points", "6", "--out", str(out / f"{method}_2x6.csv")],
        [*base, "--unit", str(unit), "--next", "--spec", "0.01", "--count", "2"],
    ]


def test_plan_runs_without_torch_and_equals_the_torch_path(trained):
    """With torch blocked, ``fedcal plan`` (a 2-plateau 6-point design, and sequential mode on
    one new 3x2 unit) runs for each of :data:`METHODS`, no torch module loaded, and
    ``FleetPrior.load(run).plan(2, 6)`` gives the command's design. Where torch is
    installed, against the forecast the torch path makes
    (:class:`fedcal.planning_torch.TorchForecaster`, ``calibrate``'s ``unit_posteriors``): the
    same design.csv and next points, the printed RMS and worst σ equal to its values to the
    printed digits (the two agree to ~1e-10 relative: tests/test_plan_numpy.py)."""
    _, new_file, root, run = trained
    frame = pd.read_csv(new_file)
    unit = root / "one_unit.csv"
    first = frame[(frame["sensor_id"] == frame["sensor_id"].iloc[0]) & (frame["split"] == "train")]
    first[COLS[:4]].to_csv(unit, index=False)
    out = root / "plans"
    out.mkdir(exist_ok=True)
    printed = {}
    for m in METHODS:
        for i, args in enumerate(_plan_args(run, m, out, unit)):
            res = _child(CLI, *args)
            assert res.returncode == 0 and "TORCH False" in res.stderr, res.stderr[-2000:]
            printed[m, i] = _printed(res.stdout)
    # the Python API's plan (FleetPrior.load(run).plan), torch blocked: the CLI's design
    res = _child(API_PLAN, str(run), str(out / "api_2x6.csv"))
    assert res.returncode == 0 and res.stdout.strip().endswith("TORCH False"), res.stderr
    assert pd.read_csv(out / "api_2x6.csv").equals(pd.read_csv(out / "fedprior_2x6.csv"))
    if not torch_available():
        return  # the core environment: nothing to compare with (module docstring)
    from fedcal import planning
    from fedcal.planning_torch import TorchForecaster

    fleet = load_fleet(unit, *_columns(run), test_fraction=0.0, min_train_points=1,
                       min_test_points=0)  # fmt: skip
    for m in METHODS:
        prior = PriorModel.load(find_prior(run, m))
        plan = planning.planner(prior, forecast=TorchForecaster(prior))
        ref = planning.optimize(plan, 2, 6)
        ours = pd.read_csv(out / f"{m}_2x6.csv")
        assert ours.equals(ref.design.frame()), (m, ours, ref.design.frame())
        row, _ = printed[m, 0]
        for col, value in (("rms_sd", ref.expected.rms), ("worst_sd", ref.expected.worst)):
            assert abs(float(row[col]) - value) <= _half_unit(row[col]) * (1 + 1e-9), (m, col)
        step = planning.unit_next(plan, fleet, spec=0.01, count=2)
        _, steps = printed[m, 1]
        assert len(steps) == len(step.steps) == 2, (m, steps)
        for (p, t, d, sd), want in zip(steps, step.steps, strict=True):
            assert (float(p), float(t), d) == want[:3], (m, steps, step.steps)
            assert abs(float(sd) - want[3]) <= _half_unit(sd) * (1 + 1e-9), (m, sd, want[3])


def _columns(run: Path) -> tuple[tuple[str, ...], str]:
    prior = PriorModel.load(find_prior(run))
    return prior.features, prior.target


@needs_torch
def test_the_torch_free_pieces_equal_the_torch_ones(trained):
    """The NumPy reader of a model file against :func:`fedcal.core.tensorfile.load_trees`
    (values, metadata, a flipped byte refused alike); the shipped default record against
    :func:`fedcal.calibration.record_template`; the declined notes' texts against fedprior's."""
    from fedcal.algorithms.fedprior_interval import DECLINE, NO_PROBE
    from fedcal.calibration import record_template
    from fedcal.core.arrayfile import TensorFileError, load_arrays
    from fedcal.core.tensorfile import load_trees
    from fedcal.prior import calibrate_dir

    _, _, root, run = trained
    path = next(run.glob("runs/fedprior_tp0_seed0/model.safetensors"))
    (ta, ma, ba), (tb, mb, bb) = load_arrays(path), load_trees(path)
    assert ma == mb and ba == bb and list(ta["params"]) == list(tb["params"])
    for k, v in tb["params"].items():
        np.testing.assert_array_equal(ta["params"][k], v.numpy(), err_msg=k)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    bad = root / "flipped.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(TensorFileError, match="checksum mismatch"):
        load_arrays(bad)
    with pytest.raises(TensorFileError, match="checksum mismatch"):
        load_trees(bad)
    assert calibrate_dir.template() == json.loads(json.dumps(record_template())), (
        "fedcal/prior/calibrate_record.json is stale: python -m fedcal.calibration"
    )
    assert DECLINE[4] == calibrate_dir.DECLINE_SMALL and calibrate_dir.NO_PROBE == NO_PROBE


if __name__ == "__main__":  # CI: train the prior with the full environment (docstring)
    make_prior(Path(sys.argv[1]))
