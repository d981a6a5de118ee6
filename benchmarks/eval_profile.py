"""Where one evaluation of every unit goes (issue 36.1): the default fedprior trained for
``--rounds`` rounds on ``--units`` simulated units (1,000 at a time, as ``prior_scale``'s
``--build chunks``), then the engine's evaluation step (``simulation._evaluate``: every
unit's posterior, its scoring on its test and train rows, the history block) run once under
cProfile. Prints the step's CPU seconds and the top functions by cumulative time.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/eval_profile.py --units 10000 --rounds 2
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=1000)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=1, help="timed evaluations, unprofiled")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).parent))
    from prior_scale import _train

    from fedcal.engine import simulation
    from fedcal.engine.simulation import EngineConfig

    algorithm, result, tensors, *_ = _train(
        args.units, args.rounds, args.chunk_size, eval_every=args.rounds, chunked=True
    )
    config = EngineConfig(rounds=args.rounds, seed=0, chunk_size=args.chunk_size)
    # the fleet as the engine evaluates it: with the moments its data fix formed once
    tensors = simulation.with_derived(algorithm, tensors, args.chunk_size)
    call = (algorithm, tensors, result.server, result.states, config, args.rounds - 1)
    device = torch.device("cpu")
    for _ in range(args.repeat):
        c = time.process_time()
        simulation._evaluate(*call, device)
        print(f"one evaluation: {time.process_time() - c:.3f} CPU s")
    profile = cProfile.Profile()
    c = time.process_time()
    profile.runcall(simulation._evaluate, *call, device)
    print(f"profiled: {time.process_time() - c:.3f} CPU s")
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(args.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
