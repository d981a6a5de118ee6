"""The fleet prior at a manufacturer's scale: 1,000 → 10,000 → 100,000 units.

Three steps per fleet size, each in its own process (its peak memory is its own):

* ``simulate`` — ``simulate_chunks`` (seed protocol, 384 + 60 rows a unit) written by
  ``save_chunks`` to Parquet, 1,000 units a row group: what ``fedcal simulate --sensors
  N`` does;
* ``load`` — that file read into the engine's tensors: ``--build frame`` ``load_fleet`` +
  ``prepare``, ``--build chunks`` ``load_fleet_chunks`` + ``prepare_chunks`` (row group by
  row group);
* ``fedprior`` — the shipped default ``fedprior`` (default.toml) trained by the
  engine for ``--rounds`` EM rounds on that fleet (simulated in the process, not read
  from a file: ``--build frame`` one pandas frame, ``--build chunks`` 1,000 sensors at a
  time through ``prepare_chunks``, no fleet-sized frame), ``--chunk-size`` units per
  client step and evaluation; seconds per round between evaluations (the spans after the
  first, wall and CPU), and the same without the evaluation (``round_only``);
* ``calibrate`` — a prior learned from ``--prior-units`` units (3 rounds), then N new
  units with a 3x2 chamber design (6 points each, fleet seed 1) calibrated against it
  through the Python API (``FleetPrior.calibrate``, the code of ``fedcal calibrate``):
  units/s of the posterior solves alone (the fleet in memory), of ``calibrate`` (reading
  and checking the file included) and of the whole command (with writing its run
  directory: coefficients, units.csv, calibration_points.csv, …). The new units' file
  holds their 6 chamber points each; ``--held-out`` adds the simulator's 60 test rows a
  unit, scored in per_sensor.csv (the protocol of the first measurements).

Peak memory: ``ru_maxrss`` of the step's own process (``resource.getrusage(RUSAGE_SELF)``
read at its end: the process's high-water mark of resident memory, torch's buffers
included — tracemalloc would miss them). A step may be given ``--mem-limit-gb``
of address space (RLIMIT_AS): beyond it, it stops with a MemoryError, reported as
such, instead of the kernel's OOM killer ending it (or a neighbour).

    python benchmarks/prior_scale.py [--sizes 1000,10000,100000]
                                     [--steps simulate,load,fedprior,calibrate]
                                     [--rounds 3] [--chunk-size 1000] [--prior-units 300]
                                     [--held-out] [--build frame|chunks]
                                     [--mem-limit-gb 12]
                                     [--trees before=/path/main,after=. [--repeat 2]]
                                     [--eval-every 1|auto|before=1,after=auto]

``--trees`` runs every step once per fedcal tree, in turn (so both see the same load on a
shared machine), and prints the mean figure of the last tree over the first's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PER_ROUND: list[tuple[float, float, str]] = []  # the last _train's rounds (wall, CPU, kind)
EVAL_ROUNDS: list[float] = []  # the last _train's evaluation steps (CPU s, with history rows)
RUN_TOTAL: list[float] = []  # the last _train's whole simulate(): wall s, CPU s, evaluations


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def step_simulate(size: int, tmp: Path, args) -> dict:
    from fedcal.data.loader import save_chunks
    from fedcal.data.simulator import FleetSpec, simulate_chunks

    # What `fedcal simulate --sensors N` runs: 1,000 sensors a chunk, a row group each.
    t0, c0 = time.perf_counter(), time.process_time()
    rows, _ = save_chunks(
        simulate_chunks(FleetSpec(num_sensors=size), seed=0, chunk_size=1000),
        tmp / "fleet.parquet",
    )
    return {
        "rows": rows,
        "simulate_write_s": time.perf_counter() - t0,
        "simulate_write_cpu_s": time.process_time() - c0,
        "file_mb": (tmp / "fleet.parquet").stat().st_size / 2**20,
    }


def step_load(size: int, tmp: Path, args) -> dict:
    """A fleet file read into the engine's tensors: ``--build frame`` ``load_fleet`` +
    ``prepare`` (one frame), ``--build chunks`` ``load_fleet_chunks`` + ``prepare_chunks``
    (a row group, 1,000 sensors, at a time). The file is written first (as ``simulate``)."""
    from fedcal.data import loader
    from fedcal.data.simulator import FleetSpec, simulate_chunks
    from fedcal.engine import simulation

    loader.save_chunks(
        simulate_chunks(FleetSpec(num_sensors=size), seed=0, chunk_size=1000),
        tmp / "fleet.parquet",
    )
    written_mb = _peak_mb()  # the high-water mark of simulating and writing
    t0, c0 = time.perf_counter(), time.process_time()
    if args.build == "chunks":
        tensors = simulation.prepare_chunks(lambda: loader.load_fleet_chunks(tmp / "fleet.parquet"))
    else:
        tensors = simulation.prepare(loader.load_fleet(tmp / "fleet.parquet"))
    return {
        "load_s": time.perf_counter() - t0,
        "load_cpu_s": time.process_time() - c0,
        "write_peak_rss_mb": written_mb,
        "tensors_mb": sum(
            t.numel() * t.element_size()
            for d in (tensors.train, tensors.test)
            for t in (d.x, d.y, d.count, d.branch)
            if t is not None
        )
        / 2**20,
    }


def _train(
    size: int,
    rounds: int,
    chunk_size: int,
    seed: int = 0,
    train_design="campaign",
    method: str = "fedprior",
    eval_every: int = 1,
    settings: dict | None = None,
    chunked: bool = False,
    workers: int | str = "auto",
):
    """The default fedprior trained on a simulated fleet: (algorithm, result, tensors, fleet,
    per-round wall and CPU seconds, build seconds). ``chunked``: the fleet simulated and
    prepared 1,000 sensors at a time (``prepare_chunks``: no fleet-sized frame; fleet None)."""
    import itertools

    from fedcal.build import build_algorithm, build_task, client_inputs
    from fedcal.config import load_config
    from fedcal.data.fleet import Fleet
    from fedcal.data.simulator import FleetSpec, simulate_chunks, simulate_fleet, simulated_meta
    from fedcal.engine import simulation
    from fedcal.engine.simulation import EngineConfig, prepare, simulate

    t0 = time.perf_counter()
    spec = FleetSpec(num_sensors=size, train_design=train_design)
    config = load_config(None)
    if chunked:
        meta = simulated_meta(spec, seed)

        def parts():
            for frame in simulate_chunks(spec, seed, chunk_size=1000):
                yield Fleet(frame, meta=meta)

        fleet = None
        tensors = simulation.prepare_chunks(parts, config.data.scaling, config.engine.dtype)
    else:
        fleet = simulate_fleet(spec, seed=seed)
        meta = fleet.meta
        tensors = prepare(fleet, config.data.scaling, config.engine.dtype)
    task = build_task(config, tensors.train.x.shape[-1], meta, client_inputs(tensors))
    algorithm = build_algorithm(method, config, task)
    if settings:  # --set: the method's settings changed (e.g. robust = "check")
        algorithm = dataclasses.replace(algorithm, **settings)
    build_s = time.perf_counter() - t0
    build_rss_mb = _peak_mb()  # the fleet's frame and tensors: the high-water mark before training
    stamps: list[tuple[int, float, float]] = []  # (round, wall, CPU) after each evaluation
    # The evaluations' own seconds (wall, CPU), to state a round's cost without them.
    evals: list[tuple[float, float]] = []
    evaluate = simulation._evaluate

    def timed(*a, **k):
        w, c = time.perf_counter(), time.process_time()
        try:
            return evaluate(*a, **k)
        finally:
            evals.append((time.perf_counter() - w, time.process_time() - c))

    simulation._evaluate = timed
    # The whole evaluation step of a round: scoring and its history rows (metrics.csv's).
    evaluate_round = simulation._evaluate_round
    eval_rounds: list[float] = []  # CPU seconds

    def round_scored(*a, **k):
        c = time.process_time()
        try:
            return evaluate_round(*a, **k)
        finally:
            eval_rounds.append(time.process_time() - c)

    simulation._evaluate_round = round_scored
    # Each round's own wall and CPU seconds (client steps, sums, server; no evaluation), and
    # its kind: "choosing" (the candidates' statistics travelled: fedprior's basis not yet
    # frozen), "chosen" (after), "holdout" (the round that holds out, R2: the last).
    train_round = simulation._train_round
    per_round: list[tuple[float, float, str]] = []

    def round_timed(run, *a, **k):
        w, c = time.perf_counter(), time.process_time()
        kind = "choosing" if "cand" in run.server else "chosen"
        if float(run.server.get("holdout_now", 0.0)) > 0:
            kind = "holdout"
        try:
            return train_round(run, *a, **k)
        finally:
            per_round.append((time.perf_counter() - w, time.process_time() - c, kind))

    simulation._train_round = round_timed
    every = int(eval_every) if str(eval_every).isdigit() else eval_every  # or "auto"
    named = {f.name for f in dataclasses.fields(EngineConfig)}
    # (a tree from before [engine] workers has none: its rounds run as they did)
    extra = {"workers": workers} if "workers" in named else {}
    engine = EngineConfig(rounds=rounds, seed=0, eval_every=every, chunk_size=chunk_size, **extra)
    start = (0, time.perf_counter(), time.process_time())
    result = simulate(
        algorithm,
        tensors,
        engine,
        on_round=lambda t, s: stamps.append((t, time.perf_counter(), time.process_time())),
    )
    # The whole run, its evaluations included (a late-scored round's too): per round below.
    RUN_TOTAL[:] = [time.perf_counter() - start[1], time.process_time() - start[2], len(evals)]
    # Seconds per round between evaluations (on_round runs only when a round evaluates).
    marks = [start, *stamps]
    wall = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in itertools.pairwise(marks)]
    cpu = [(b[2] - a[2]) / (b[0] - a[0]) for a, b in itertools.pairwise(marks)]
    simulation._evaluate = evaluate
    simulation._evaluate_round = evaluate_round
    simulation._train_round = train_round
    PER_ROUND[:] = per_round  # (read by step_fedprior)
    EVAL_ROUNDS[:] = eval_rounds
    # Without the evaluation that ends each span (one per span: on_round follows it).
    bare = [
        ((b[1] - a[1] - e[0]) / (b[0] - a[0]), (b[2] - a[2] - e[1]) / (b[0] - a[0]))
        for (a, b), e in zip(itertools.pairwise(marks), evals, strict=False)
    ]
    return algorithm, result, tensors, fleet, wall, cpu, build_s, build_rss_mb, bare, evals


def step_fedprior(size: int, tmp: Path, args) -> dict:
    from fedcal.engine import streamed
    from fedcal.engine.simulation import EngineConfig

    if args.stream_above_mb >= 0:  # the engine's bound on assembled replies (0: always stream)
        streamed.STREAM_ABOVE = int(args.stream_above_mb * 2**20)
    settings = dict(_setting(kv) for kv in args.set.split(",") if kv)
    algorithm, result, _, _, wall, cpu, build_s, build_rss_mb, bare, evals = _train(
        size,
        args.rounds,
        args.chunk_size,
        method=args.method,
        eval_every=args.eval_every,
        settings=settings,
        chunked=args.build == "chunks",
        workers=args.workers if args.workers == "auto" else int(args.workers),
    )
    # Streamed when eligible and the assembled replies would pass the bound (engine._streams).
    refused = streamed.eligible(algorithm, EngineConfig().aggregation)
    assembled = result.bytes_up_per_round
    steady = slice(1, None) if len(wall) > 1 else slice(None)
    return {
        "build_s": build_s,
        "first_round_s": wall[0],
        "round_s": sum(wall[steady]) / len(wall[steady]),
        "round_cpu_s": sum(cpu[steady]) / len(cpu[steady]),
        # the same spans without their evaluation (E-step, server, streaming only)
        "round_only_s": sum(w for w, _ in bare[steady]) / len(bare[steady]),
        "round_only_cpu_s": sum(c for _, c in bare[steady]) / len(bare[steady]),
        "eval_cpu_s": evals[-1][1],  # the last evaluation of every unit, CPU
        # the whole run per round, evaluations included (--eval-every: how many, and which)
        "run_s_per_round": RUN_TOTAL[0] / result.rounds_done,
        "run_cpu_s_per_round": RUN_TOTAL[1] / result.rounds_done,
        "evaluations": RUN_TOTAL[2],
        # ... with its history rows (the engine's whole evaluation step; the last round's)
        "eval_step_cpu_s": EVAL_ROUNDS[-1] if EVAL_ROUNDS else float("nan"),
        "bytes_up_per_round": result.bytes_up_per_round,
        # per unit: the mean over the rounds run, and the last round's (issue 36.1: once the
        # basis is chosen only its statistics travel); the rounds run (fewer than --rounds
        # when the prior converged) and the basis chosen
        "up_kb_per_unit": result.bytes_up_per_round / size / 1e3,
        "up_kb_per_unit_last": result.extra.get("bytes_up", [0])[-1] / size / 1e3,
        "up_kb_per_unit_first": result.extra.get("bytes_up", [0])[0] / size / 1e3,
        "rounds_done": result.rounds_done,
        "choice": int(result.server["choice"]) if "choice" in result.server else -1,
        "build_peak_rss_mb": build_rss_mb,
        # each round without its evaluation: those that still carried every candidate's
        # statistics (choosing), and those after the basis was frozen (issue 36.1)
        **_split_rounds(PER_ROUND),
        "streamed": refused is None and assembled > streamed.STREAM_ABOVE,
        **({"stream_refused": refused} if refused else {}),
    }


def _split_rounds(rounds: list[tuple[float, float, str]]) -> dict:
    """Mean wall and CPU seconds of the rounds that chose (candidates), of those after the
    choice, and of the round that held out; the slowest of each (its wall, CPU)."""
    out = {}
    for label in ("choosing", "chosen", "holdout"):
        part = [(w, c) for w, c, kind in rounds if kind == label]
        out[f"{label}_rounds"] = len(part)
        if part:
            out[f"{label}_round_s"] = sum(w for w, _ in part) / len(part)
            out[f"{label}_round_cpu_s"] = sum(c for _, c in part) / len(part)
            out[f"{label}_round_max_s"] = max(w for w, _ in part)
            # which round was the slowest (0 = the first), its CPU seconds (issue 36.1)
            slow = max(range(len(rounds)), key=lambda i: (rounds[i][2] == label, rounds[i][0]))
            out[f"{label}_round_max_index"] = slow
            out[f"{label}_round_max_cpu_s"] = rounds[slow][1]
    out["all_rounds_s"] = sum(w for w, _, _ in rounds)
    # every round's wall and CPU seconds in order (the slowest named, not only timed)
    out["rounds_wall_s"] = [round(w, 2) for w, _, _ in rounds]
    out["rounds_cpu_s"] = [round(c, 2) for _, c, _ in rounds]
    return out


def _setting(kv: str) -> tuple[str, object]:
    key, _, value = kv.partition("=")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a word: a string setting


def step_calibrate(size: int, tmp: Path, args) -> dict:
    from fedcal import calibration
    from fedcal.api import FleetPrior
    from fedcal.data.loader import save_fleet
    from fedcal.data.simulator import FleetSpec, simulate_fleet
    from fedcal.experiment import export_state

    algorithm, result, tensors, fleet, *_ = _train(args.prior_units, 3, args.chunk_size)
    prior = export_state(algorithm, result.server, fleet, tensors, "fedprior")
    (tmp / "prior.json").write_text(json.dumps(prior, indent=1))
    new = simulate_fleet(FleetSpec(num_sensors=size, train_design="3x2"), seed=1)
    if not args.held_out:  # a new unit's file: its chamber points only
        new = type(new)(
            new.frame[new.frame["split"] == "train"].reset_index(drop=True),
            new.features,
            new.target,
            new.client_column,
            new.meta,
        )
    # Units outside the prior fleet's range (calibrate refuses them, naming the first):
    # left out, and counted (at 100,000 new units a few are, with a 300-unit prior).
    frame = new.frame
    spans = frame[frame["split"] == "train"].groupby("sensor_id")
    outside = set()
    for c, (lo, hi) in prior["input_range"].items():
        slack = calibration.RANGE_TOLERANCE * (hi - lo)
        span = spans[c].agg(["min", "max"])
        outside |= set(span.index[(span["min"] < lo - slack) | (span["max"] > hi + slack)])
    if outside:
        kept = frame[~frame["sensor_id"].isin(outside)].reset_index(drop=True)
        new = type(new)(kept, new.features, new.target, new.client_column, new.meta)
    size = size - len(outside)
    save_fleet(new, tmp / "new.parquet")
    rows = len(new.frame)
    del new
    loaded = FleetPrior.load(tmp / "prior.json")
    t0, c0 = time.perf_counter(), time.process_time()
    units = loaded.calibrate(tmp / "new.parquet")
    t1, c1 = time.perf_counter(), time.process_time()
    units.save(tmp / "out")
    t2, c2 = time.perf_counter(), time.process_time()
    # The solves alone, on the fleet already read (the file's read and checks excluded).
    calibration.calibrate(loaded.model_, units.fleet)
    t3, c3 = time.perf_counter(), time.process_time()
    return {
        "rows": rows,
        "outside_range": len(outside),
        "solves_units_per_s": size / (t3 - t2),
        "solves_units_per_cpu_s": size / (c3 - c2),
        "calibrate_s": t1 - t0,
        "calibrate_units_per_s": size / (t1 - t0),
        "calibrate_units_per_cpu_s": size / (c1 - c0),
        "with_save_units_per_s": size / (t2 - t0),
        "with_save_units_per_cpu_s": size / (c2 - c0),
    }


STEPS = {
    "simulate": step_simulate,
    "load": step_load,
    "fedprior": step_fedprior,
    "calibrate": step_calibrate,
}


def one(size: int, step: str, args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    if args.mem_limit_gb > 0:
        limit = int(args.mem_limit_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    with tempfile.TemporaryDirectory(prefix="prior_scale_") as tmp:
        try:
            out = STEPS[step](size, Path(tmp), args)
        except MemoryError:
            out = {"error": f"MemoryError beyond {args.mem_limit_gb:g} GB of address space"}
    import fedcal

    tree = str(Path(fedcal.__file__).parents[2])
    return {"units": size, "step": step, "peak_rss_mb": _peak_mb(), **out, "tree": tree}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--steps", default="simulate,fedprior,calibrate")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=1000, help="0 = the whole fleet")
    parser.add_argument("--prior-units", type=int, default=300)
    parser.add_argument("--method", default="fedprior", help="fedprior: a fedprior variant")
    parser.add_argument(
        "--eval-every",
        default="1",
        help='fedprior: evaluate every k rounds, or "auto"; with --trees, per tree: '
        "before=1,after=auto",
    )
    parser.add_argument(
        "--held-out",
        action="store_true",
        help="calibrate: the new units' file also holds 60 test rows a unit (scored)",
    )
    parser.add_argument(
        "--set", default="", help="fedprior: method settings, e.g. robust=check,interval=posterior"
    )
    parser.add_argument(
        "--stream-above-mb",
        type=float,
        default=-1.0,
        help="fedprior: stream rounds whose assembled replies pass this (0: always; -1: default)",
    )
    parser.add_argument(
        "--build",
        choices=("frame", "chunks"),
        default="frame",
        help="fedprior: the training fleet as one frame, or 1,000 sensors at a time",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--workers",
        default="auto",
        help='fedprior: [engine] workers, threads computing a streamed round\'s chunks ("auto": '
        "the cores the process may use, at most 8)",
    )
    parser.add_argument(
        "--trees",
        default="",
        help="label=root,...: run each step with each fedcal tree in turn (root/src first "
        "on PYTHONPATH); prints each run and the last/first ratios",
    )
    parser.add_argument("--repeat", type=int, default=1, help="--trees: runs per tree")
    parser.add_argument("--mem-limit-gb", type=float, default=12.0, help="0 = no limit")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--step", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.step, args)))
        return
    print(
        f"rounds={args.rounds} chunk_size={args.chunk_size} threads={args.threads} "
        f"prior_units={args.prior_units} mem_limit_gb={args.mem_limit_gb:g}"
    )
    print(f"load at start: {os.getloadavg()[0]:.2f} (1-min), cores: {os.cpu_count()}")
    passed = [a for a in sys.argv[1:]]
    trees = dict(t.split("=", 1) for t in args.trees.split(",")) if args.trees else {"": ""}
    for size in (int(s) for s in args.sizes.split(",")):
        for step in args.steps.split(","):
            runs: dict[str, list[dict]] = {label: [] for label in trees}
            for _ in range(args.repeat if args.trees else 1):
                for label, root in trees.items():  # the trees in turn (the same load for each)
                    r = _run(size, step, passed + _tree_eval_every(args.eval_every, label), root)
                    tag = f"{label:<8} " if label else ""
                    if "failed" in r:
                        print(f"{size:>7} {step:<9} {tag}FAILED {r['failed']}")
                        continue
                    runs[label].append(r)
                    figures = " ".join(
                        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in r.items()
                        if k not in ("units", "step")
                    )
                    print(f"{size:>7} {step:<9} {tag}{figures}  (load {os.getloadavg()[0]:.2f})")
                    sys.stdout.flush()
            if args.trees and all(runs.values()):
                _ratios(size, step, runs)


def _tree_eval_every(value: str, label: str) -> list[str]:
    """``--eval-every before=1,after=auto``: the tree's own value (argparse: the last wins)."""
    if "=" not in value:
        return []
    return ["--eval-every", dict(v.split("=", 1) for v in value.split(","))[label]]


def _run(size: int, step: str, passed: list[str], root: str) -> dict:
    """One step in its own process; ``root``: the fedcal tree it imports ('' = as installed)."""
    env = dict(os.environ)
    if root:
        src = str(Path(root).resolve())
        env["PYTHONPATH"] = os.pathsep.join([f"{src}/src", src])
    proc = subprocess.run(
        [sys.executable, __file__, *passed, "--one", str(size), "--step", step],
        capture_output=True,
        text=True,
        env=env,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"failed": f"(exit {proc.returncode}): {tail}"}
    return json.loads(lines[-1])


def _ratios(size: int, step: str, runs: dict[str, list[dict]]) -> None:
    """Each float figure's mean over the repeats, last tree / first tree."""
    (first, a), (last, b) = next(iter(runs.items())), list(runs.items())[-1]
    keys = [k for k, v in a[0].items() if isinstance(v, float) and isinstance(b[0].get(k), float)]
    ratios = " ".join(
        f"{k}={sum(r[k] for r in b) / len(b) / (sum(r[k] for r in a) / len(a)):.3f}"
        for k in keys
        if sum(r[k] for r in a) != 0
    )
    print(f"{size:>7} {step:<9} ratio {last}/{first} (mean of {len(a)}): {ratios}")


if __name__ == "__main__":
    main()
