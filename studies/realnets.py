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
        --gas /work/.mirror/BrechtDewilde1+BDProject/repo --simulated 0,1 --zero 2
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from fedcal.data.field import TARGET, FieldSpec, field_frame, hard_units, seconds
from fedcal.data.fleet import CLIENT_COLUMN, SPLIT_COLUMN
from fedcal.data.loader import time_split
from fedcal_support import realnets
from fedcal_support.realnets import baselines, summarize
from fedcal_support.scripts import compare_in

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

[methods.fedprior_modelsigma]  # fedprior with the model's own σ after calibration
base = "fedprior"
choice_interval = "off"
"""


def simulated(
    seed: int, few: int = 3, zero: int = 3
) -> tuple[pd.DataFrame, tuple[str, ...], str, str]:
    """The generated network: 12 drifting PM2.5 units, ``few`` of them few-data, ``zero``
    zero-inflated (``--zero``: 2 and 8, a mostly zero-inflated network)."""
    spec = FieldSpec(num_sensors=12)
    frame = field_frame(spec, seed)
    frame["time"] = seconds(frame["time"])
    frame[SPLIT_COLUMN] = time_split(
        frame[CLIENT_COLUMN].to_numpy(), frame["time"].to_numpy(), 0.25
    )
    frame = hard_units(frame, few=few, zero=zero, seed=seed)
    return frame, spec.features(), TARGET, "pm25_raw"


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
    compare_in(where, config)
    rows = summarize(net, baselines(frame, features, target), where / "run", methods)
    for row in rows:
        print(row, flush=True)
    return rows


def markdown(results: pd.DataFrame) -> str:
    lines = [
        "| network | method | RMSE mean (all sensors) | worst | / best linear | statuses "
        "| ok at > 3× own linear | coverage 95 %: mean / worst (declined) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for _, r in results.iterrows():
        if r.get("statuses") == "failed":
            lines.append(f"| {r['network']} | {r['method']} | failed | | | | | |")
            continue
        ratio = f"{r['ratio']:.3f}" if pd.notna(r.get("ratio")) else "–"
        if pd.notna(r.get("coverage_mean")):
            cov = f"{r['coverage_mean']:.3f} / {r['coverage_worst']:.3f} ({int(r['declined'])})"
        elif pd.notna(r.get("declined")) and r["declined"] > 0:
            cov = f"declined ({int(r['declined'])})"
        else:
            cov = "–"
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
    parser.add_argument(
        "--zero", default="", help="fleet seeds of a zero-inflated network (8 of 12 units, 2 few)"
    )
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
    for seed in [int(s) for s in args.zero.split(",") if s]:
        frame, features, target, raw = simulated(seed, few=2, zero=8)
        net = f"zero-{seed}"
        rows += run_network(args.out / net, frame, (features, target, raw), methods, net)
    results = pd.DataFrame(rows)
    results.to_csv(args.out / "realnets.csv", index=False)
    print(markdown(results))


if __name__ == "__main__":
    main()
