"""Real co-location networks (issue 34): fedcal's default prior against per-sensor and
pooled linear least squares, tested on the last quarter of each sensor's time.

Each network is written to a CSV by :mod:`fedcal_support.realnets` (from the public git
mirrors, never committed) or generated (``simulated``: :mod:`fedcal.data.field`'s drifting
PM2.5 network with few-data and zero-inflated units, :func:`fedcal.data.field.hard_units`)
and run through the CLI as a user would,

    fedcal compare --config <out>/<net>/run.toml --out <out>/<net>/run -q

with ``[data] time_column = "time"`` (the file's split column: each sensor's last quarter
is test) and, where a feature reads the target itself, ``raw_column``. The baselines are
fitted here, not by fedcal: each sensor's own linear least squares in every feature with an
intercept, and one pooled linear least squares over all sensors' calibration rows (the
exact fit, no clipping), both on the same calibration rows and scored on the same test
rows. Per method: the mean and worst sensor's RMSE over **all** sensors (whatever their
status), its ratio to the better baseline's mean, the statuses, the sensors with status ok
at more than 3 × their own linear fit, and the 95 % intervals' coverage (mean over sensors
with an interval; declined units counted). Markdown on stdout, every number in
``<out>/realnets.csv``.

    PYTHONPATH=src:. python studies/realnets.py --out /tmp/realnets \
        --purpleair /work/.mirror/MartineMathieu+PurpleAir-calibration/repo \
        --antwerp /work/.mirror/LaurentSpi+SensEURCity_Ineris/repo \
        --gas /work/.mirror/BrechtDewilde1+BDProject/repo --simulated 0,1
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from fedcal.data.field import TARGET, FieldSpec, field_frame, hard_units, seconds
from fedcal.data.fleet import CLIENT_COLUMN, SPLIT_COLUMN
from fedcal.data.loader import time_split
from fedcal_support import realnets

METHODS = ("fedprior", "fedprior_drift", "fedprior_bic")
CONFIG = """\
[run]
methods = {methods}
seeds = 1

[data]
path = "{path}"
features = {features}
target = "{target}"
time_column = "time"
raw_column = "{raw}"

[engine]
eval_every = 50

[methods.fedprior_bic]         # before issue 34: the in-sample (BIC) choice, no fall-back
base = "fedprior"
choose = "off"
"""


def simulated(seed: int) -> tuple[pd.DataFrame, tuple[str, ...], str, str]:
    """The generated network: 12 drifting PM2.5 units, 3 of them few-data, 3 zero-inflated."""
    spec = FieldSpec(num_sensors=12)
    frame = field_frame(spec, seed)
    frame["time"] = seconds(frame["time"])
    frame[SPLIT_COLUMN] = time_split(
        frame[CLIENT_COLUMN].to_numpy(), frame["time"].to_numpy(), 0.25
    )
    frame = hard_units(frame, seed=seed)
    return frame, spec.features(), TARGET, "pm25_raw"


def baselines(frame: pd.DataFrame, features: tuple[str, ...], target: str) -> pd.DataFrame:
    """Per sensor: test RMSE of its own linear least squares and of the pooled one."""
    train = frame[frame[SPLIT_COLUMN] == "train"]

    def design(part: pd.DataFrame) -> np.ndarray:
        return np.column_stack([np.ones(len(part)), part[list(features)].to_numpy(float)])

    pooled = np.linalg.lstsq(design(train), train[target].to_numpy(float), rcond=None)[0]
    rows = []
    for sid, part in frame.groupby(CLIENT_COLUMN, sort=True):
        tr, te = part[part[SPLIT_COLUMN] == "train"], part[part[SPLIT_COLUMN] == "test"]
        own = np.linalg.lstsq(design(tr), tr[target].to_numpy(float), rcond=None)[0]
        y = te[target].to_numpy(float)
        rows.append(
            {
                CLIENT_COLUMN: str(sid),
                "own_linear": float(np.sqrt(np.mean((design(te) @ own - y) ** 2))),
                "pooled_linear": float(np.sqrt(np.mean((design(te) @ pooled - y) ** 2))),
            }
        )
    return pd.DataFrame(rows)


def per_sensor(run: Path, method: str) -> pd.DataFrame | None:
    for f in sorted((run / "runs").glob(f"{method}*/per_sensor.csv")):
        table = pd.read_csv(f)
        if table["method"].iloc[0] == method:
            return table
    return None


def summarize(net: str, base: pd.DataFrame, run: Path, methods: list[str]) -> list[dict]:
    best = min(base["own_linear"].mean(), base["pooled_linear"].mean())
    rows = [
        {"network": net, "method": m, "rmse_mean": base[m].mean(), "rmse_worst": base[m].max()}
        for m in ("own_linear", "pooled_linear")
    ]
    for method in methods:
        table = per_sensor(run, method)
        row: dict = {"network": net, "method": method}
        if table is None:
            rows.append({**row, "statuses": "failed"})
            continue
        table = table.assign(**{CLIENT_COLUMN: table["client"].astype(str)})
        run_ids, base_ids = set(table[CLIENT_COLUMN]), set(base[CLIENT_COLUMN].astype(str))
        missing = sorted(base_ids ^ run_ids)  # a mean over fewer sensors is not "all sensors"
        if missing:
            shown = ", ".join(missing[:5]) + (" …" if len(missing) > 5 else "")
            rows.append(
                {
                    **row,
                    "statuses": f"failed: {len(missing)} sensor(s) not in both "
                    f"the run and the simple fits ({shown})",
                }
            )
            continue
        both = table.merge(base.astype({CLIENT_COLUMN: str}), on=CLIENT_COLUMN)
        assert len(both) == len(base), f"{net} {method}: sensors repeated in the merge"
        rmse = both["test_rmse"].to_numpy(float)
        status = both["status"].astype(str)
        far = (rmse > 3 * both["own_linear"].to_numpy()) & (status == "ok").to_numpy()
        row.update(rmse_mean=rmse.mean(), rmse_worst=rmse.max(), ratio=rmse.mean() / best)
        row["statuses"] = ", ".join(f"{k} {v}" for k, v in status.value_counts().items())
        row["ok_far"] = int(far.sum())
        if "test_coverage95" in both:
            cov = both["test_coverage95"].to_numpy(float)
            row["coverage_mean"] = float(np.nanmean(cov)) if np.isfinite(cov).any() else np.nan
            row["declined"] = int((~np.isfinite(cov)).sum())
        for col in ("choice", "fallback"):
            if col in both:
                row[col] = ", ".join(f"{k} {v}" for k, v in both[col].value_counts().items())
        rows.append(row)
    return rows


def run_network(
    where: Path, frame: pd.DataFrame, spec: tuple, methods: list[str], net: str
) -> list[dict]:
    features, target, raw = spec
    where.mkdir(parents=True, exist_ok=True)
    frame.to_csv(where / "network.csv", index=False)
    config = CONFIG.format(
        methods=methods,
        path=where / "network.csv",
        features=list(features),
        target=target,
        raw=raw,
    ).replace("'", '"')
    (where / "run.toml").write_text(config)
    cmd = [sys.executable, "-c", "from fedcal.cli import app; app()", "compare"]
    cmd += ["--config", str(where / "run.toml"), "--out", str(where / "run"), "-q"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    (where / "stderr.txt").write_text(done.stdout + done.stderr)
    rows = summarize(net, baselines(frame, features, target), where / "run", methods)
    for row in rows:
        print(row, flush=True)
    return rows


def markdown(results: pd.DataFrame) -> str:
    lines = [
        "| network | method | RMSE mean (all sensors) | worst | / best linear | statuses "
        "| ok at > 3× own linear | coverage 95 % (declined) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for _, r in results.iterrows():
        if r.get("statuses") == "failed":
            lines.append(f"| {r['network']} | {r['method']} | failed | | | | | |")
            continue
        ratio = f"{r['ratio']:.3f}" if pd.notna(r.get("ratio")) else "–"
        cov = (
            f"{r['coverage_mean']:.3f} ({int(r['declined'])})"
            if pd.notna(r.get("coverage_mean"))
            else "–"
        )
        lines.append(
            f"| {r['network']} | {r['method']} | {r['rmse_mean']:.4g} | {r['rmse_worst']:.4g} "
            f"| {ratio} | {r.get('statuses', '') if pd.notna(r.get('statuses')) else ''} "
            f"| {'' if pd.isna(r.get('ok_far')) else int(r['ok_far'])} | {cov} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    for name in realnets.CONVERTERS:
        parser.add_argument(f"--{name}", type=Path, help=f"the {name} mirror's git dir")
    parser.add_argument("--simulated", default="0", help="fleet seeds ('' for none)")
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args()
    methods = args.methods.split(",")
    rows = []
    for name, convert in realnets.CONVERTERS.items():
        mirror = getattr(args, name)
        if mirror is None:
            continue
        frame = convert(mirror)
        rows += run_network(args.out / name, frame, realnets.NETWORKS[name], methods, name)
    for seed in [int(s) for s in args.simulated.split(",") if s]:
        frame, features, target, raw = simulated(seed)
        net = f"simulated-{seed}"
        rows += run_network(args.out / net, frame, (features, target, raw), methods, net)
    results = pd.DataFrame(rows)
    results.to_csv(args.out / "realnets.csv", index=False)
    print(markdown(results))


if __name__ == "__main__":
    main()
