"""A streamed fedprior run against the assembled one (issue 25.1; fedcal/engine/streamed.py).

For each fleet seed: a simulated fleet (``--units``, campaign design, 384 + 60 rows a
unit), ``fedprior_fixed`` with ``robust = --robust`` (default "check") and ``interval =
"posterior"`` (the setting that streams) trained ``--rounds`` rounds, ``--chunk-size``
units a chunk, once assembled (the engine's default bound, far above these fleets) and
once streamed (bound 0).
Prints the largest relative difference of the server's leaves, whether the rejections are
the same, and the test RMSE (hPa, off the training grid: the simulator's random P, T rows)
of both runs, mean and worst sensor. ``--interval calibrated --new N``: the shipped
interval (own_folds as configured) on a mixed fleet, ``--units`` reference units
(campaign design) and N new units of ``--new-design`` (3x2: 6 points, the probe's class),
the interval's probe rows and test coverage95 too (mean and lowest over the units that
state an interval; how many state none).

    python benchmarks/stream_equal.py [--units 300] [--seeds 0,1,2] [--rounds 3]
                                      [--interval calibrated --new 100 --new-design 3x2]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch


def run(
    units: int,
    seed: int,
    rounds: int,
    chunk: int,
    robust: str = "check",
    interval: str = "posterior",
    new: int = 0,
    new_design: str = "3x2",
) -> None:
    from fedcal.build import build_algorithm, build_task, client_inputs
    from fedcal.config import load_config
    from fedcal.core.aggregation import AggregationPolicy
    from fedcal.core.tree import flatten
    from fedcal.data.simulator import FleetSpec, simulate_fleet
    from fedcal.engine import streamed
    from fedcal.engine.simulation import EngineConfig, prepare, simulate

    if new:  # a mixed fleet: reference units (campaign) and new units (new_design)
        spec = FleetSpec(num_reference=units, num_new=new, train_design=new_design)
    else:
        spec = FleetSpec(num_sensors=units, train_design="campaign")
    fleet = simulate_fleet(spec, seed=seed)
    config = load_config(None)
    tensors = prepare(fleet, config.data.scaling, config.engine.dtype)
    task = build_task(config, tensors.train.x.shape[-1], fleet.meta, client_inputs(tensors))
    algorithm = build_algorithm("fedprior_fixed", config, task)
    algorithm = dataclasses.replace(algorithm, robust=robust, interval=interval)
    engine = EngineConfig(rounds=rounds, seed=0, chunk_size=chunk, aggregation=AggregationPolicy())
    bound = streamed.STREAM_ABOVE
    runs = {}
    for name, above in (("assembled", bound), ("streamed", 0)):
        streamed.STREAM_ABOVE = above
        runs[name] = simulate(algorithm, tensors, engine)
    streamed.STREAM_ABOVE = bound
    a, s = (flatten(runs[k].server) for k in ("assembled", "streamed"))
    diffs = {
        k: float(
            (s[k].double() - v.double()).abs().max() / v.double().abs().max().clamp_min(1e-300)
        )
        for k, v in a.items()
        if v.is_floating_point() and v.numel()
    }
    worst = max(diffs, key=diffs.get)
    # the same units, rounds and reasons (a reason's ratio may differ in its last digits)
    same = [
        [(r["round"], r["client_index"], r["reason"]) for r in runs[k].extra["rejections"]]
        for k in ("assembled", "streamed")
    ]
    same = same[0] == same[1]
    rmse = {
        k: torch.tensor([row["test_rmse"] for row in r.final], dtype=torch.float64)
        for k, r in runs.items()
    }
    cover = ""
    if interval == "calibrated":
        for k, r in runs.items():
            c = torch.tensor([row["test_coverage95"] for row in r.final], dtype=torch.float64)
            ok = ~torch.isnan(c)
            low = f"{float(c[ok].min()):.3f}" if bool(ok.any()) else "none"
            mean = f"{float(c[ok].mean()):.3f}" if bool(ok.any()) else "none"
            cover += (
                f", {k} probe_n {float(r.server['probe_n']):g} coverage95 mean {mean} "
                f"lowest {low} no interval {int((~ok).sum())}"
            )
    print(
        f"seed {seed}: units {units}, robust {robust}, "
        f"max relative server difference {diffs[worst]:.2e} ({worst}), "
        f"rejections equal {same} ({len(runs['streamed'].extra['rejections'])}), "
        + ", ".join(
            f"{k} test RMSE mean {float(v.mean()):.4f} worst {float(v.max()):.4f}"
            for k, v in rmse.items()
        )
        + cover,
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--units", type=int, default=300)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=100)
    parser.add_argument("--robust", default="check", help="fedprior's robust: check, full, off")
    parser.add_argument("--interval", default="posterior", help="posterior or calibrated")
    parser.add_argument("--new", type=int, default=0, help="new units (a mixed fleet); 0: none")
    parser.add_argument("--new-design", default="3x2", help="the new units' chamber design")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for seed in (int(s) for s in args.seeds.split(",")):
        run(
            args.units,
            seed,
            args.rounds,
            args.chunk_size,
            args.robust,
            args.interval,
            args.new,
            args.new_design,
        )


if __name__ == "__main__":
    main()
