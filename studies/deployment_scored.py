"""Where the deployment emulation scores (issue 33): its held-out rows against the
reference units' own off-grid test points, same units, same designs, same σ.

Per fleet: the prior from the 20 reference units (``FleetPrior.fit``, what ``fedcal run``
does, learning prior.json's ``discrepancy``); then each reference unit is calibrated as a
new unit from the rows of one emulated design (``fedprior_deploy.unit_designs``, the rows
the emulation keeps) against that stored prior (``FleetPrior.calibrate``) and scored with
``predict``'s σ on (a) its other campaign rows, the emulation's held-out rows, and (b) its
60 random off-grid test points (random direction). Per design family: the share of
descending rows, coverage of ascending / descending / all rows, and (a)'s coverage with
each sweep direction weighted half (direction-balanced scoring: tried, not kept). The full prior
contains the unit (the emulation's leave-one-out does not): (a) and (b) share that.

    python studies/deployment_scored.py --sim fedcal --fleet-seeds 0
    python studies/deployment_scored.py --sim crosscheck --ref-designs grid --fleet-seeds 0,1
    python studies/deployment_scored.py --sim crosscheck --ref-designs lhs --fleet-seeds 3,8,11 \
        --real 3x2
    python studies/deployment_scored.py --population 0-22

``--real 3x2`` (cross-check only): also the same reference units calibrated from a real
3×2 grid of their own (the generator's chamber plan, as a new unit is measured) and
scored on the same test points: whether the emulated design stands for the real one.

``--population``: per fleet seed, the hysteresis of the 20 reference units against the 20
new units (RMS and largest; fedcal's H, the cross-check's η): what a prior learned from the
references cannot see, and the mean over seeds of the new/reference RMS ratio.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import deployment_sigma as ds

from fedcal.algorithms import fedprior_deploy as fd
from fedcal.api import FleetPrior
from fedcal.data.simulator import FleetSpec, sensor_parameters

Z95 = 1.959964
FAMILIES = ("3x2", "4x3", "6x4", "8x5", "max-grid")


def emulated_frames(refs: pd.DataFrame, family: int):
    """Each reference unit's rows of one emulated design (train), its other campaign rows
    (held) and its test points, as new units E<id>; None if no unit has that family."""
    train, held, test = [], [], []
    for k, (sid, g) in enumerate(refs.groupby("sensor_id", sort=True)):
        rows = g[g["split"] == "train"].reset_index(drop=True)
        x = rows[["frequency_hz", "temperature_c"]].to_numpy()
        up = (rows["direction"] == "up").to_numpy()
        design = [r for f, r in fd.unit_designs(x, up, k) if f == family]
        if not design:
            return None
        keep = np.zeros(len(rows), bool)
        keep[design[0]] = True
        name = "E" + str(sid)
        train.append(rows[keep].assign(sensor_id=name))
        held.append(rows[~keep].assign(sensor_id=name))
        test.append(g[g["split"] == "test"].assign(sensor_id=name))
    return (pd.concat(f, ignore_index=True) for f in (train, held, test))


def scored(units, frame: pd.DataFrame) -> dict[str, float]:
    mean, sd = units.predict(frame[ds.COLUMNS[:3]], return_std=True)
    inside = np.abs(frame["pressure_hpa"].to_numpy() - np.asarray(mean).ravel()) <= Z95 * (
        np.asarray(sd).ravel()
    )
    down = (frame["direction"] == "down").to_numpy()
    return {
        "down share": float(down.mean()),
        "cov up": float(inside[~down].mean()),
        "cov down": float(inside[down].mean()),
        "cov": float(inside.mean()),
        "cov balanced": float(0.5 * inside[~down].mean() + 0.5 * inside[down].mean()),
    }


def real_grid(seed: int, design: str) -> pd.DataFrame:
    """The cross-check's reference units 0–19 measured on a real P×T grid (train rows),
    named as :func:`emulated_frames` names them."""
    p, t = (int(v) for v in design.split("x"))
    plan = ds.cc.plateau_campaign(
        np.linspace(ds.cc.P_LO, ds.cc.P_HI, p), np.linspace(ds.cc.T_LO, ds.cc.T_HI, t), False
    )
    units = ds.cc.make_units(seed, 40)
    frames = []
    for i in range(20):
        rng = np.random.default_rng([seed, 2, i, 99])
        rows = ds.cc.unit_rows(units.iloc[i], plan, rng, ds.cc.Nominal(), "train")
        rows.insert(0, "sensor_id", f"EU{i:03d}")
        frames.append(rows)
    return pd.concat(frames, ignore_index=True)[ds.COLUMNS]


def population(first: int, last: int) -> None:
    """Hysteresis of the references against the new units, per seed and simulator."""
    spec = FleetSpec(num_reference=20, num_new=20, train_design="3x2", test_design="random")
    print(
        "| seed | fedcal H RMS ref / new (ratio) | max ref / new | "
        "cross-check η RMS ref / new (ratio) | max ref / new |"
    )
    print("|---:|---|---|---|---|")
    ratios = []
    for seed in range(first, last + 1):
        cells = []
        for h in (
            sensor_parameters(spec, seed)["hysteresis_hpa"].to_numpy(),
            ds.cc.make_units(seed, 40)["eta"].to_numpy(),
        ):
            ref, new = np.sqrt(np.mean(h[:20] ** 2)), np.sqrt(np.mean(h[20:] ** 2))
            ratios.append(new / ref)
            cells += [
                f"{ref:.4f} / {new:.4f} ({new / ref:.2f})",
                f"{h[:20].max():.3f} / {h[20:].max():.3f}",
            ]
        print(f"| {seed} | " + " | ".join(cells) + " |")
    r = np.array(ratios).reshape(-1, 2)
    print(
        f"\nmean ratio new/ref over seeds: fedcal {r[:, 0].mean():.3f}, "
        f"cross-check {r[:, 1].mean():.3f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sim", default="fedcal", choices=["fedcal", "crosscheck"])
    ap.add_argument("--ref-designs", default="grid", help="crosscheck only")
    ap.add_argument("--fleet-seeds", default="0")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--real", help="crosscheck: also a real grid of this design (e.g. 3x2)")
    ap.add_argument("--population", help="seeds FIRST-LAST: the hysteresis table only")
    args = ap.parse_args()
    if args.population:
        population(*(int(v) for v in args.population.split("-")))
        return
    torch.set_num_threads(1)
    out = []
    refs_list = ["campaign"] if args.sim == "fedcal" else args.ref_designs.split(",")
    for ref in refs_list:
        for seed in (int(s) for s in args.fleet_seeds.split(",")):
            base = (
                ds.fedcal_fleet(seed, "3x2")
                if args.sim == "fedcal"
                else ds.cc_rows(seed, ref, "3x2")
            )
            refs = base[base["role"] == "reference"]
            prior = FleetPrior(rounds=args.rounds).fit(refs[ds.COLUMNS])
            for name in FAMILIES:
                frames = emulated_frames(refs, fd.FAMILIES.index(name))
                if frames is None:
                    continue
                train, held, test = frames
                units = prior.calibrate(train[ds.COLUMNS])
                scores = [("held-out rows", units, held), ("off-grid test", units, test)]
                if args.real == name and args.sim == "crosscheck":
                    real = prior.calibrate(real_grid(seed, name))
                    scores.append((f"off-grid test, real {name}", real, test))
                for where, fitted, frame in scores:
                    out.append(
                        {
                            "sim": args.sim,
                            "ref": ref,
                            "seed": seed,
                            "design": name,
                            "scored": where,
                            **scored(fitted, frame),
                        }
                    )
    frame = pd.DataFrame(out)
    print("| " + " | ".join(frame.columns) + " |")
    print("|" + "---|" * len(frame.columns))
    for row in frame.itertuples(index=False):
        print("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row) + " |")


if __name__ == "__main__":
    main()
