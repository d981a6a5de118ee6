"""Which stages of the exported C header need double precision (docs/firmware.md).

Per fleet seed: a mixed fleet (8 fully calibrated reference units + 6 new units
with a 3x2 chamber design, off-grid random test points), trained with the
linear-in-basis methods; each header is compiled (gcc, -O2) with every stage at
its default and with one stage switched to float (-DFEDCAL_<STAGE>_T=float),
then every unit is evaluated at 200 random points inside its calibrated span
and 200 more within 50 % of the span beyond it (float32 inputs) and compared
with ``fedcal predict`` (float64). Prints the largest |C − predict| in hPa of
``fedcal_calibrate_d`` (double out) and ``fedcal_calibrate`` (float out), and
the largest relative σ error: over the in-span points, then over the points
beyond the unit's support box of the extrapolation guard (``beyond_support``;
their count is printed; fedpoly and leastsq have no guard: 0).

    python benchmarks/c_export_precision.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedcal_support import cheader

METHODS = ("fedprior", "fedprior_branch", "polynomial", "fedpoly_p3", "leastsq")
VARIANTS = {
    "default": {},
    "scale float": {"FEDCAL_SCALE_T": "float"},
    "basis float": {"FEDCAL_BASIS_T": "float"},
    "sum float": {"FEDCAL_SUM_T": "float"},
    "coef float": {"FEDCAL_COEF_T": "float"},
    "std double": {"FEDCAL_STD_T": "double"},
    "box double": {"FEDCAL_BOX_T": "double"},
}


def train(root: Path, seed: int) -> Path:
    from typer.testing import CliRunner

    from fedcal.cli import app
    from fedcal.data.simulator import FleetSpec, simulate_fleet

    spec = FleetSpec(num_reference=8, num_new=6, train_design="3x2", test_design="random")
    data = root / "fleet.csv"
    simulate_fleet(spec, seed=seed).frame.to_csv(data, index=False)
    cfg = root / "c.toml"
    cfg.write_text("[engine]\nrounds = 30\neval_every = 30\n")
    out = root / "run"
    args = ["run", "--data", str(data), "--methods", ",".join(METHODS), "--seeds", "1"]
    result = CliRunner().invoke(app, [*args, "--config", str(cfg), "--out", str(out), "--quiet"])
    if result.exit_code != 0:
        raise SystemExit(result.output)
    return out


def measure(run: Path, method: str, work: Path, defines: dict) -> np.ndarray:
    """(in-span: err double, err float, rel σ err; beyond the box: the same three, rows)."""
    import torch

    from fedcal.core.tree import stack
    from fedcal.report.export import load_models, to_c_header
    from fedcal.report.rundir import predictive_std, read_valid_ranges

    fleet = load_models(run, method)
    ranges = read_valid_ranges(run, method, 0, 0)
    header = work / f"{method}.h"
    header.write_text(to_c_header(fleet, valid_range=ranges, method=method))
    exe = cheader.build(header, work / f"b_{method}", defines)
    rng = np.random.default_rng(1)
    far = np.random.default_rng(2)
    sensors = sorted(fleet.params)
    rows, xs, inside = [], [], []
    for i, s in enumerate(sensors):
        lo = np.array([ranges[s][c][0] for c in fleet.features])
        hi = np.array([ranges[s][c][1] for c in fleet.features])
        xs.append((lo + rng.uniform(0, 1, (200, len(lo))) * (hi - lo)).astype(np.float32))
        xs.append((lo + far.uniform(-0.5, 1.5, (200, len(lo))) * (hi - lo)).astype(np.float32))
        rows += [i] * 400
        inside += [True] * 200 + [False] * 200
    x = np.concatenate(xs).astype(float)
    rows, inside = np.array(rows), np.array(inside)
    out = cheader.evaluate(exe, rows, x)
    err = np.zeros(7)
    check = getattr(fleet.algorithm, "beyond_support", None)
    for i, s in enumerate(sensors):
        r = rows == i
        want = fleet.predict(s, x[r])[:, 0]
        sd = predictive_std(fleet, s, x[r])
        beyond = np.zeros(int(r.sum()), bool)
        if check is not None:
            params = {k: v.double() for k, v in stack([fleet.params[s]]).items()}
            z = torch.as_tensor(fleet.scaler.x(x[r]), dtype=torch.float64).unsqueeze(0)
            beyond = check(params, z)[0].numpy()
        for part, sel in ((0, inside[r]), (3, beyond)):
            if not sel.any():
                continue
            got = out[r][sel]
            err[part] = max(err[part], float(np.max(np.abs(got[:, 0] - want[sel]))))
            err[part + 1] = max(err[part + 1], float(np.max(np.abs(got[:, 1] - want[sel]))))
            if sd is not None:
                rel = np.abs(got[:, 2] / sd.ravel()[sel] - 1)
                err[part + 2] = max(err[part + 2], float(np.max(rel)))
        err[6] += beyond.sum()
    return err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    worst: dict[tuple[str, str], np.ndarray] = {}
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            run = train(root, seed)
            for method in METHODS:
                for name, defines in VARIANTS.items():
                    work = root / f"{method}_{name.replace(' ', '_')}"
                    work.mkdir()
                    got = np.array(measure(run, method, work, defines))
                    key = (method, name)
                    worst[key] = got if key not in worst else np.maximum(worst[key], got)
                    print(
                        f"seed {seed} {method:16s} {name:12s} " + " ".join(f"{v:.3g}" for v in got),
                        flush=True,
                    )
    print(
        f"\nworst over fleet seeds {args.seeds}: |C double − predict| hPa, |C float − predict| hPa,"
    )
    print("relative σ error: in the span | beyond the guard's box (rows beyond, most in a seed)")
    for (method, name), v in worst.items():
        print(
            f"{method:16s} {name:12s} {v[0]:10.3g} {v[1]:10.3g} {v[2]:10.3g} |"
            f" {v[3]:10.3g} {v[4]:10.3g} {v[5]:10.3g} ({int(v[6])})"
        )


if __name__ == "__main__":
    main()
