"""Issue 37.1 for a manufacturer's prior: new units calibrated from a prior learned on
reference units alone (its deployment discrepancy model, issue 33: D1–D4 of
:mod:`fedcal.prior.discrepancy`), with torch not importable.

The prior (:func:`make_reference_prior`: fedprior on 14 reference units,
ν₀ = ∞ as learned) and a copy with a finite ν₀ = 3 (the per-unit scale s_i² and the Student-t
factor of D4 in use): ``calibrate`` → ``predict`` → ``export`` C and JSON → ``certificate``
→ ``report`` of 3 new 3x2 units and one 6x1 unit (one temperature level: declined with its
reason) run with torch blocked, every exit 0, no torch module loaded; where torch is
installed they equal the torch path's outputs within the tolerances derived in
tests/prior/test_torch_free.py (``SOLVE_TOL``: the posterior's solves; σ of D2–D4 is a
function of that posterior, of the design rows and the model's numbers, which both paths
hold equal to the bit, and, with ν₀ finite, of d_i² = rᵀC⁻¹r, a Cholesky solve of the same
backward error: so σ agrees to ``SOLVE_TOL`` × the target's scale like every value in the
target's unit; measured ≲ 1e-15 hPa on ~1000 hPa), the served predictions to ``SERVE_TOL``,
the C header, JSON and certificate pages byte-equal. Before the NumPy path covered the
model, the blocked ``calibrate`` exited 3 with "needs fedcal[neural]".

CI (.ci/run) runs this file in the clean core environment too (FEDCAL_STATION_DIR).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fedcal.cli import app
from fedcal.core.arrayfile import load_arrays
from fedcal.data.simulator import FleetSpec, simulate_fleet
from fedcal.prior.find import find_prior
from fedcal.prior.model import PriorModel
from fedcal.report.served import torch_available
from tests.prior.test_torch_free import (
    CHAIN,
    CLI,
    COLS,
    SERVE_TOL,
    TORCH_PATH,
    _child,
    _compare_calibrated,
    _half_unit,
    _plan_args,
    _printed,
    runner,
    station_root,
)

DECLINED = "ONE-T-S000"
REASON = "no σ: the design has 1 level(s) of temperature_c"


def make_reference_prior(root: Path) -> None:
    """A manufacturer's prior: fedprior on 14 reference units only (its deployment
    discrepancy model, issue 33) in ``root/ref_run``; new units in ``root/ref_new_units.csv``:
    3 of a 3x2 design and ``ONE-T-S000`` of a 6x1 one (one temperature level: declined).
    Needs torch (CI: ``python -m tests.prior.test_torch_free_deployed DIR``)."""
    root.mkdir(parents=True, exist_ok=True)
    simulate_fleet(FleetSpec(num_reference=14, num_new=0), seed=3).frame.to_csv(
        root / "ref_fleet.csv", index=False
    )
    cfg = root / "ref_prior.toml"
    cfg.write_text("[engine]\nrounds = 10\neval_every = 10\n")
    args = ["run", "--data", str(root / "ref_fleet.csv"), "--methods", "fedprior", "--seeds", "1"]
    result = runner.invoke(app, [*args, "--config", str(cfg), "--out", str(root / "ref_run")])
    assert result.exit_code == 0, result.output
    parts = []
    for tag, design, n, seed in (("NEW-", "3x2", 3, 9), ("ONE-T-", "6x1", 1, 10)):
        spec = FleetSpec(num_sensors=n, train_design=design, test_design="random")
        frame = simulate_fleet(spec, seed).frame
        parts.append(frame.assign(sensor_id=tag + frame["sensor_id"])[COLS])
    pd.concat(parts).to_csv(root / "ref_new_units.csv", index=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(the reference-only run folder, a prior.json copy with ν₀ = 3 and E[s²] per knot
    planted, the new units, scratch)."""
    root = station_root(tmp_path_factory, "reference_only", make_reference_prior)
    scratch = tmp_path_factory.mktemp("deployed")
    run = root / "ref_run"
    doc = json.loads(find_prior(run).read_text())
    assert doc["discrepancy"]["nu0"] is None  # as learned: ν₀ = ∞
    doc["discrepancy"]["nu0"] = 3.0
    knots = len(doc["discrepancy"]["kappa_points"]) or 1  # E[s²] per knot ≠ 1: plan takes it
    doc["discrepancy"]["mean_scale2"] = [2.0 - 0.1 * k for k in range(knots)]
    finite = scratch / "prior_nu3.json"
    PriorModel.from_dict(doc).save(finite)
    return run, finite, root / "ref_new_units.csv", scratch


def _steps(prior: Path, data: Path, out: Path, readings: Path, src: Path) -> list[list[str]]:
    """calibrate into ``out`` → predict → export c, json → certificate → report of the
    calibrate output ``src`` (as in test_torch_free: both paths serve the torch-free one)."""
    return [
        ["calibrate", "--prior", str(prior), "--data", str(data), "--out", str(out)],
        ["predict", str(src), "--data", str(readings), "--out", f"{out}_pred.csv"],
        ["export", str(src), "--format", "c", "--out", f"{out}.h"],
        ["export", str(src), "--format", "json", "--out", f"{out}.json"],
        ["certificate", str(src), "--out", f"{out}_cert", "--issued", "2026-01-02"],
        ["report", str(src)],
    ]


@pytest.mark.parametrize("which", ["learned", "nu0_finite"])
def test_a_reference_only_prior_s_units_run_without_torch(reference, which):
    """With torch blocked the chain exits 0 for every step, loads no torch; the 3x2 units
    get D2–D4's σ (``gp_amp`` = a² > 0 in the model file, a finite ``_std`` wherever they
    are read), the 6x1 unit none (NaN ``_std``, its reason the run's note); against the
    torch path (where installed): the module docstring's tolerances."""
    run, finite, new_file, root = reference
    prior = run if which == "learned" else finite
    frame = pd.read_csv(new_file)
    readings = root / "readings.csv"
    frame[frame["split"] == "test"][COLS[:3]].to_csv(readings, index=False)
    ours = root / f"np_{which}"
    res = _child(CHAIN, json.dumps(_steps(prior, new_file, ours, readings, ours)))
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"CODES {json.dumps([0] * 6)}" in res.stdout, (res.stdout[-2000:], res.stderr[-2000:])
    assert "TORCH False" in res.stdout
    trees, meta, _ = load_arrays(next(ours.glob("runs/*/model.safetensors")))
    amp = dict(zip(meta["client_ids"], trees["params"]["gp_amp"], strict=True))
    assert all(amp[u] > 0 for u in amp if u != DECLINED), amp  # D2–D4's σ, not fedprior's
    served = pd.read_csv(f"{ours}_pred.csv")
    std = served.groupby("sensor_id")["pressure_hpa_std"]
    assert std.apply(lambda s: s.isna().all())[DECLINED]
    assert std.apply(lambda s: np.isfinite(s).all()).drop(DECLINED).all()
    note = pd.read_csv(ours / "summary.csv")["coverage_note"].iloc[0]
    assert note.startswith(REASON), note
    assert (Path(f"{ours}_cert") / "NEW-S000.pdf").stat().st_size > 0
    if not torch_available():
        return  # the core environment: nothing to compare with
    theirs = root / f"t_{which}"
    steps = json.dumps(_steps(prior, new_file, theirs, readings, ours))
    ref = _child(TORCH_PATH + CHAIN, steps, block=False)  # FedPrior's calibrate and serving
    assert f"CODES {json.dumps([0] * 6)}" in ref.stdout and "TORCH True" in ref.stdout, ref.stderr
    scale = float(frame.loc[frame["split"] == "train", "pressure_hpa"].abs().max())
    _compare_calibrated(ours, theirs, "fedprior", scale)
    a, b = pd.read_csv(f"{ours}_pred.csv"), pd.read_csv(f"{theirs}_pred.csv")  # served alike
    for col in a.columns:
        if a[col].dtype.kind == "f":
            assert (a[col].isna() == b[col].isna()).all(), col
            assert np.nanmax(np.abs(a[col] - b[col])) <= SERVE_TOL * scale, col
        else:
            assert (a[col] == b[col]).all(), col
    for suffix in (".h", ".json"):
        assert Path(f"{ours}{suffix}").read_bytes() == Path(f"{theirs}{suffix}").read_bytes()
    pages = sorted(Path(f"{theirs}_cert").glob("*.html"))
    assert len(pages) == 4
    for page in pages:
        assert (Path(f"{ours}_cert") / page.name).read_bytes() == page.read_bytes(), page


@pytest.mark.parametrize("which", ["learned", "nu0_finite"])
def test_plan_of_a_reference_only_prior_runs_without_torch(reference, which):
    """``fedcal plan`` (a 2-plateau 6-point design; sequential mode on one new 3x2 unit) with
    torch blocked, no torch module loaded; where torch is installed the same design and next
    points as :class:`fedcal.planning_torch.TorchForecaster` (``calibrate``'s torch path, a
    new unit's s_i² at its expectation), the printed RMS and worst σ equal to its values to
    the printed digits (the two forecasts agree to ~1e-13 relative, measured)."""
    run, finite, new_file, root = reference
    prior = run if which == "learned" else finite
    frame = pd.read_csv(new_file)
    unit = root / "one_unit.csv"
    first = frame[(frame["sensor_id"] == "NEW-S000") & (frame["split"] == "train")]
    first[COLS[:4]].to_csv(unit, index=False)
    out = root / f"plans_{which}"
    out.mkdir(exist_ok=True)
    printed = []
    for args in _plan_args(prior, "fedprior", out, unit):
        res = _child(CLI, *args)
        assert res.returncode == 0 and "TORCH False" in res.stderr, res.stderr[-2000:]
        printed.append(_printed(res.stdout))
    if not torch_available():
        return  # the core environment: nothing to compare with
    from fedcal import planning
    from fedcal.data.loader import load_fleet
    from fedcal.planning_torch import TorchForecaster

    model = PriorModel.load(find_prior(prior))
    plan = planning.planner(model, forecast=TorchForecaster(model))
    ref = planning.optimize(plan, 2, 6)
    assert pd.read_csv(out / "fedprior_2x6.csv").equals(ref.design.frame())
    row, _ = printed[0]
    for col, value in (("rms_sd", ref.expected.rms), ("worst_sd", ref.expected.worst)):
        assert abs(float(row[col]) - value) <= _half_unit(row[col]) * (1 + 1e-9), (col, value)
    fleet = load_fleet(unit, model.features, model.target, test_fraction=0.0,
                       min_train_points=1, min_test_points=0)  # fmt: skip
    step = planning.unit_next(plan, fleet, spec=0.01, count=2)
    _, steps = printed[1]
    assert len(steps) == len(step.steps) == 2, steps
    for (p, t, d, sd), want in zip(steps, step.steps, strict=True):
        assert (float(p), float(t), d) == want[:3], (steps, step.steps)
        assert abs(float(sd) - want[3]) <= _half_unit(sd) * (1 + 1e-9), (sd, want[3])


if __name__ == "__main__":  # CI: train the prior with the full environment (docstring)
    make_reference_prior(Path(sys.argv[1]))
