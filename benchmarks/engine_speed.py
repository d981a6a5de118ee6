"""Vectorized engine vs the idiomatic eager per-client loop, FedGMI on the seed protocol.

Both run the same math in one process with the same thread settings: 20
sensors × 384 calibration points, MLP 2-64-64-1 (tanh), 50 rounds × 5 local
epochs, batch 32, SGD. The eager loop is ``fedcal.engine.reference.run_loop``
(nn.Module + optim.SGD, one client after another, per-parameter Python loops
for the interpolation), timed twice: fed by a shuffling ``DataLoader`` per
client, as popular pFL libraries write it (the headline ratio, last line
``speedup_vs_loop: <ratio>``), and fed the engine's own minibatch plan, which
also proves the two compute the same numbers (``max_param_diff``).
Evaluation is left out of all timings.

The machine may be shared: ``--repeat N`` runs the whole comparison N times
(each repeat prints its own ratios; quote ratios within one repeat) and the
process CPU time of each timing is printed beside its wall time.

``--threads 1,2`` runs the comparison at each thread count and then compares each
side at its own fastest count (printed as such; the headline ratios stay those at
equal thread counts).

    python benchmarks/engine_speed.py [--rounds 50] [--threads 1] [--repeat 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from fedcal.algorithms.fedgmi import FedGMI
from fedcal.core.task import Task
from fedcal.data.simulator import FleetSpec, simulate_fleet
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal.models.mlp import MLP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fedcal_support/ (not shipped)
from fedcal_support.reference import run_loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument(
        "--threads", default="1", help="torch threads; a list (1,2) runs the comparison at each"
    )
    parser.add_argument("--sensors", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    thread_counts = [int(t) for t in str(args.threads).split(",")]
    for r in range(args.repeat):
        if args.repeat > 1:
            print(f"repeat: {r + 1}")
        times = {}
        for threads in thread_counts:
            torch.set_num_threads(threads)
            args.threads = threads
            times[threads] = compare(args)
        if len(thread_counts) > 1:
            best_thread_counts(times)


def best_thread_counts(times: dict[int, dict[str, float]]) -> None:
    """Each side at its own fastest thread count (within this repeat), said as such."""
    best = {
        side: min(times, key=lambda t, side=side: times[t][side])
        for side in ("vectorized", "plan", "dataloader")
    }
    vec = times[best["vectorized"]]["vectorized"]
    print(
        f"best threads: vectorized {best['vectorized']}, eager same-batch {best['plan']}, "
        f"eager DataLoader {best['dataloader']}"
    )
    for side, label in (("plan", "same_batch_loop"), ("dataloader", "loop")):
        loop = times[best[side]][side]
        print(f"speedup_vs_{label}_each_at_best_threads: {loop / vec:.1f}")


def timed(fn):
    """``(result, wall s, process CPU s)`` of ``fn()``."""
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w0, time.process_time() - c0


def compare(args: argparse.Namespace) -> dict[str, float]:
    fleet = prepare(simulate_fleet(FleetSpec(num_sensors=args.sensors), seed=0))
    model = MLP(hidden=(64, 64), activation="tanh")
    hp = dict(lr=0.05, local_epochs=5, batch_size=32)
    alg = FedGMI(Task(model), finetune_lr=0.05, **hp)
    config = EngineConfig(rounds=args.rounds, seed=0, eval_every=args.rounds + 1)

    result, vectorized, vectorized_cpu = timed(lambda: simulate(alg, fleet, config))

    init = model.init(torch.Generator().manual_seed(0), torch.float32)
    loops, loops_cpu = {}, {}
    for loader in ("plan", "dataloader"):
        (personal, _), loops[loader], loops_cpu[loader] = timed(
            lambda loader=loader: run_loop(
                "fedgmi",
                model,
                init,
                fleet.train,
                rounds=args.rounds,
                seed=0,
                lr=0.05,
                epochs=5,
                batch_size=32,
                finetune_lr=0.05,
                loader=loader,
            )
        )
        if loader == "plan":
            plan_personal = personal
    personal = plan_personal

    # Same math: the two runs agree up to float32 rounding.
    diff = max(
        float((result.personal[k][c] - personal[c][k]).abs().max())
        for c in range(len(personal))
        for k in personal[c]
    )
    print(
        f"protocol: {args.sensors} sensors x 384 points, {args.rounds} rounds x 5 epochs, "
        f"batch 32, MLP 2-64-64-1, threads={args.threads}"
    )
    print(f"vectorized_s: {vectorized:.2f} (cpu {vectorized_cpu:.2f})")
    print(f"eager_loop_same_batches_s: {loops['plan']:.2f} (cpu {loops_cpu['plan']:.2f})")
    print(f"eager_loop_dataloader_s: {loops['dataloader']:.2f} (cpu {loops_cpu['dataloader']:.2f})")
    print(f"max_param_diff_same_batches: {diff:.2e}")
    print(f"speedup_vs_same_batch_loop: {loops['plan'] / vectorized:.1f}")
    print(f"speedup_vs_loop: {loops['dataloader'] / vectorized:.1f}")
    return {"vectorized": vectorized, **loops}


if __name__ == "__main__":
    main()
