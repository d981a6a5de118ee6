"""How the vectorized engine scales with the fleet: 20 → 200 → 2,000 → 10,000 sensors.

FedGMI, seed protocol per sensor (384 calibration points, MLP 2-64-64-1,
5 local epochs, batch 32), every sensor evaluated every round. Each fleet
size runs in its own process so that peak resident memory (ru_maxrss) belongs
to that size alone. Prints, per size: seconds per round (mean of the rounds
after the first; wall and CPU time of the process), peak memory over the whole
process and its high-water mark right after the fleet build, the resident
memory when training starts (the build's garbage returned to the system) and
its peak during training (the high-water mark reset at the start, Linux), and
the fleet build's time (simulating the fleet + padding it into tensors).
``train_peak_MB − train_start_MB`` is what the rounds themselves add.

``--chunk-size K`` trains and evaluates K sensors at a time (``[engine]
chunk_size``; the numbers do not depend on it): memory stays bounded by K
instead of growing with the fleet's activations. ``--policy`` is the server's
aggregation policy: ``default`` (the shipped ``[aggregation]``: screening at 10×
and clipping at 3× the median update norm) or ``plain`` (only non-finite
replies rejected).

    python benchmarks/fleet_scale.py [--sizes 20,200,2000,10000] [--rounds 3]
                                     [--chunk-size 0] [--threads 1] [--policy default]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import itertools
import json
import resource
import subprocess
import sys
import time


def one(size: int, rounds: int, chunk_size: int, threads: int, policy: str) -> dict:
    import torch

    from fedcal.algorithms.fedgmi import FedGMI
    from fedcal.core.aggregation import PLAIN, AggregationPolicy
    from fedcal.core.task import Task
    from fedcal.data.simulator import FleetSpec, simulate_fleet
    from fedcal.engine.simulation import EngineConfig, prepare, simulate
    from fedcal.models.mlp import MLP

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    fleet = simulate_fleet(FleetSpec(num_sensors=size), seed=0)
    t1 = time.perf_counter()
    tensors = prepare(fleet)
    t2 = time.perf_counter()
    del fleet
    # The high-water mark so far belongs to the build (the pandas frame of every row).
    build_peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # Training's own peak: the build's freed memory returned to the system, then the
    # kernel's high-water mark reset (Linux: /proc/self/clear_refs) and read after the run.
    gc.collect()
    _malloc_trim()
    train_start_mb = _proc_status_mb("VmRSS")
    peak_reset = _reset_peak_rss()
    alg = FedGMI(Task(MLP()), lr=0.05, local_epochs=5, batch_size=32)
    stamps: list[tuple[float, float]] = []
    aggregation = AggregationPolicy() if policy == "default" else PLAIN
    config = EngineConfig(
        rounds=rounds, seed=0, eval_every=1, chunk_size=chunk_size, aggregation=aggregation
    )
    start = (time.perf_counter(), time.process_time())
    result = simulate(
        alg,
        tensors,
        config,
        on_round=lambda t, s: stamps.append((time.perf_counter(), time.process_time())),
    )
    train_peak_mb = _proc_status_mb("VmHWM") if peak_reset else float("nan")
    marks = [start, *stamps]
    wall = [b[0] - a[0] for a, b in itertools.pairwise(marks)]
    cpu = [b[1] - a[1] for a, b in itertools.pairwise(marks)]
    steady = slice(1, None) if len(wall) > 1 else slice(None)
    diverged = sum(row["status"] != "ok" for row in result.final)
    return {
        "sensors": size,
        "simulate_s": t1 - t0,
        "prepare_s": t2 - t1,
        "first_round_s": wall[0],
        "round_s": sum(wall[steady]) / len(wall[steady]),
        "round_cpu_s": sum(cpu[steady]) / len(cpu[steady]),
        # Resetting VmHWM resets ru_maxrss too: the process's peak is the larger of the two.
        "peak_rss_mb": max(
            build_peak_mb, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        ),
        "build_peak_rss_mb": build_peak_mb,
        "train_start_mb": train_start_mb,
        "train_peak_mb": train_peak_mb,
        "diverged": diverged,
    }


def _proc_status_mb(field: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of this process, in MB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ≥ 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _malloc_trim() -> None:
    """Give glibc's free heap back to the system, so RSS counts only live memory."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="20,200,2000,10000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=0, help="0 = the whole fleet at once")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--policy",
        choices=("default", "plain"),
        default="default",
        help="server aggregation: the shipped [aggregation] defaults, or PLAIN",
    )
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.rounds, args.chunk_size, args.threads, args.policy)))
        return
    print(
        f"rounds={args.rounds} chunk_size={args.chunk_size} threads={args.threads} "
        f"policy={args.policy}"
    )
    header = (
        "sensors",
        "round_s",
        "round_cpu_s",
        "s/sensor/round",
        "peak_rss_MB",
        "after_build_MB",
        "train_start_MB",
        "train_peak_MB",
        "build_s",
    )
    print("{:>8} {:>9} {:>12} {:>15} {:>12} {:>15} {:>15} {:>14} {:>20}".format(*header))
    for size in (int(s) for s in args.sizes.split(",")):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--one",
                str(size),
                "--rounds",
                str(args.rounds),
                "--chunk-size",
                str(args.chunk_size),
                "--threads",
                str(args.threads),
                "--policy",
                args.policy,
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        build = f"{r['simulate_s']:.2f} + {r['prepare_s']:.2f}"
        note = f"  ({r['diverged']} diverged)" if r["diverged"] else ""
        print(
            f"{r['sensors']:>8} {r['round_s']:>9.3f} {r['round_cpu_s']:>12.3f} "
            f"{r['round_s'] / size:>15.5f} {r['peak_rss_mb']:>12.0f} "
            f"{r['build_peak_rss_mb']:>15.0f} {r['train_start_mb']:>15.0f} "
            f"{r['train_peak_mb']:>14.0f} {build:>20}{note}"
        )


if __name__ == "__main__":
    main()
