"""Rounds to convergence of the shipped fedprior (issue 36.1): plain EM against SQUAREM.

For each fleet seed of ``make run``'s fleet (quickstart: 20 reference + 20 new 3x2 units,
off-grid test points), the shipped ``fedprior`` (chamber preset) runs through the engine
(``simulate``) for 50 rounds (the reference), 100 rounds (how far the reference itself still
is from EM's fixed point: the tolerance), and R rounds plain and with ``accelerate =
"squarem"`` (fedprior_accel). Per run: the new units' test RMSE (mean, worst unit) and
coverage, every unit's largest relative RMSE change against the reference, the fleet's σ²,
τ² and log-likelihood Σ_i log p(y_i | θ) at the final prior (the units' E-step under it).

    OMP_NUM_THREADS=1 PYTHONPATH=src nice -n 10 python benchmarks/prior_rounds.py \
        --seeds 0,1,2 --rounds 25,30,35,40 > prior_rounds.txt

Each line: the run, then its figures against the 50-round plain run's (relative for σ², τ²
and RMSE; differences for ℓ and coverage).

Session 15 (``--modes``, ``--fleet``, ``--bar``; PX-EM was measured with them on a branch:
docs/benchmarks.md): with ``--bar 50 --reference 200`` the reference is plain EM at 200
rounds (its fixed point as near as this script gets) and the bar is plain EM's 50-round
distance to it; a run ``passes`` on a seed when its largest unit RMSE change and its |τ²
rel.| are both within the bar's (τ² = 0 in both: within). ``--fleet crosscheck``:
studies/crosscheck.py's generator (20 ``grid`` reference units, 20
new units of 6 points, 40 test points each):

    OMP_NUM_THREADS=1 PYTHONPATH=src:studies nice -n 10 python benchmarks/prior_rounds.py \
        --seeds 0,1,2,3 --rounds 20,25,30,35,40 --reference 200 --bar 50 \
        --modes squarem --fleet quickstart
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from fedcal.build import build_algorithm, build_task, client_inputs
from fedcal.config import load_config
from fedcal.core.tree import expand
from fedcal.data.simulator import Fleet, simulate_fleet
from fedcal.engine.simulation import EngineConfig, prepare, simulate


def _fleet(seed: int, kind: str):
    config = load_config("quickstart")
    if kind == "crosscheck":  # studies/crosscheck.py on the path (PYTHONPATH=src:studies)
        import crosscheck

        fleet = Fleet(crosscheck.make_fleet(seed, "grid", 20, 20, 6))
    else:
        fleet = simulate_fleet(config.fleet, seed=seed)
    tensors = prepare(fleet, config.data.scaling, config.engine.dtype)
    task = build_task(config, tensors.train.x.shape[-1], fleet.meta, client_inputs(tensors))
    return build_algorithm("fedprior", config, task), tensors


def _figures(alg, tensors, rounds: int) -> dict:
    result = simulate(alg, tensors, EngineConfig(rounds=rounds, seed=0, eval_every=rounds))
    server = result.server
    n = tensors.num_clients
    fit = alg.client_update(expand(alg.broadcast(server), n), result.states, tensors.train)
    rows = sorted(result.final, key=lambda r: r["client_index"])
    rmse = torch.tensor([float(r["test_rmse"]) for r in rows], dtype=torch.float64)
    cover = torch.tensor([float(r["test_coverage95"]) for r in rows])
    new = torch.tensor([r["client_index"] >= n // 2 for r in rows])
    return {
        "rounds": result.rounds_done,
        "s2": float(server["noise_var"]),
        "tau2": float(server.get("disc_var", float("nan"))),
        "ll": float(fit.metrics["loglik"].sum()),
        "rmse": rmse,
        "rmse_new": float(rmse[new].mean()),
        "worst_new": float(rmse[new].max()),
        "cover_new": float(cover[new].mean()),
    }


def _rel(a: float, b: float) -> float:
    return a / b - 1 if b else (0.0 if a == 0 else float("inf"))


def _distance(f: dict, ref: dict) -> tuple[float, float]:
    """(largest unit's relative RMSE change, |τ² rel.|) of run ``f`` against ``ref``."""
    unit = float(((f["rmse"] - ref["rmse"]).abs() / ref["rmse"]).max())
    return unit, abs(_rel(f["tau2"], ref["tau2"]))


def _line(tag: str, f: dict, ref: dict, bar: tuple[float, float] | None = None) -> str:
    rel = _rel
    here = _distance(f, ref)
    unit = here[0]
    verdict = ""
    if bar is not None:
        verdict = "  pass" if here[0] <= bar[0] and here[1] <= bar[1] else "  FAIL"
    return (
        f"{tag:>14} rounds {f['rounds']:3d}  σ² {rel(f['s2'], ref['s2']):+.2e}  "
        f"τ² {rel(f['tau2'], ref['tau2']):+.2e} ({f['tau2']:.3e})  ℓ {f['ll'] - ref['ll']:+9.2f}  "
        f"new RMSE {rel(f['rmse_new'], ref['rmse_new']):+.2e} worst "
        f"{rel(f['worst_new'], ref['worst_new']):+.2e}  "
        f"coverage {f['cover_new'] - ref['cover_new']:+.4f}"
        f"  unit max {unit:.2e}{verdict}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", default="25,30,35,40")
    parser.add_argument("--reference", type=int, default=50)
    parser.add_argument("--bar", type=int, default=0, help="plain rounds whose distance is the bar")
    parser.add_argument("--modes", default="squarem", help="accelerate settings to compare")
    parser.add_argument("--fleet", default="quickstart", choices=["quickstart", "crosscheck"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    modes = args.modes.split(",")
    for seed in (int(s) for s in args.seeds.split(",")):
        alg, tensors = _fleet(seed, args.fleet)
        ref = _figures(alg, tensors, args.reference)
        print(
            f"seed {seed}: plain {args.reference} rounds: σ² {ref['s2']:.6e} τ² {ref['tau2']:.6e} "
            f"ℓ {ref['ll']:.2f} new RMSE {ref['rmse_new']:.6f} worst {ref['worst_new']:.6f} "
            f"coverage {ref['cover_new']:.4f}"
        )
        bar = None
        if args.bar:
            bar = _distance(_figures(alg, tensors, args.bar), ref)
            print(f"{'bar':>14} plain {args.bar}: unit max {bar[0]:.2e}  |τ² rel.| {bar[1]:.2e}")
        else:
            print(
                _line(
                    f"plain {2 * args.reference}", _figures(alg, tensors, 2 * args.reference), ref
                )
            )
        for r in (int(x) for x in args.rounds.split(",")):
            print(_line(f"plain {r}", _figures(alg, tensors, r), ref, bar))
            for mode in modes:
                fast = dataclasses.replace(alg, accelerate=mode)
                print(_line(f"{mode} {r}", _figures(fast, tensors, r), ref, bar), flush=True)
        if not args.bar:
            fast = dataclasses.replace(alg, accelerate=modes[0])
            print(
                _line(f"{modes[0]} {args.reference}", _figures(fast, tensors, args.reference), ref)
            )


if __name__ == "__main__":
    main()
