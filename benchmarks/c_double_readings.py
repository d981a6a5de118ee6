"""What float readings cost in the exported C header, and what double readings give back
(issue 37.5; docs/firmware.md "Double readings").

A finished run (default: make run's, runs/default) is exported with `fedcal export --format c`
for one method (default fedprior); the header is compiled with the system C compiler and every
unit is evaluated at 200 random readings inside its calibrated span, in full double precision
(a frequency counter's reading, not a float). Printed: the largest |C − predict| (hPa) and
relative difference of `fedcal_calibrate_f64` (double readings) and of `fedcal_calibrate_d`
(the same readings rounded to float first), against `CalibratedFleet.predict` in float64.

    python benchmarks/c_double_readings.py --run runs/default --method fedprior
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedcal_support import cheader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=Path("runs/default"))
    parser.add_argument("--method", default="fedprior")
    parser.add_argument("--rows", type=int, default=200)
    args = parser.parse_args()
    from fedcal.report.export import load_models, to_c_header
    from fedcal.report.rundir import read_valid_ranges

    fleet = load_models(args.run, args.method)
    ranges = read_valid_ranges(args.run, args.method)
    sensors = sorted(fleet.params)
    rng = np.random.default_rng(0)
    idx, xs, want = [], [], []
    for i, s in enumerate(sensors):
        lo = np.array([ranges[s][c][0] for c in fleet.features])
        hi = np.array([ranges[s][c][1] for c in fleet.features])
        x = lo + rng.uniform(0, 1, (args.rows, len(lo))) * (hi - lo)
        idx += [i] * args.rows
        xs.append(x)
        want.append(fleet.predict(s, x)[:, 0])
    x, want = np.concatenate(xs), np.concatenate(want)
    with tempfile.TemporaryDirectory() as tmp:
        header = Path(tmp) / "cal.h"
        header.write_text(to_c_header(fleet, valid_range=ranges, method=args.method))
        got = cheader.evaluate(cheader.build(header, Path(tmp) / "b"), np.array(idx), x)
    for name, col in (("double readings (_f64)", 6), ("float readings (_d)", 0)):
        err = np.abs(got[:, col] - want)
        print(
            f"{args.method}, {len(sensors)} units x {args.rows} readings, {name}: "
            f"max |C - predict| {err.max():.2g} {fleet.target}, "
            f"max relative {np.max(err / np.abs(want)):.2g}"
        )


if __name__ == "__main__":
    main()
