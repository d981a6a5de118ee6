"""Where ``fedcal run`` spends memory and time, phase by phase (issue 25.1).

Runs the ``fedcal run`` command line given after ``--`` in this process, with the run's
steps wrapped: the load (``load_run_data``), the methods' check, each client step and
aggregation (assembled or streamed), the moments formed once (``with_derived``), each
evaluation, the checkpoint, and the run directory's writing (metrics, statuses,
per_sensor.csv, the model file, valid_range.json, prior.json, the summary table). For
each phase it prints the peak resident memory *during* the phase (the kernel's high-water
mark ``VmHWM``, reset at each phase's start by writing 5 to ``/proc/self/clear_refs``;
torch's buffers included, which tracemalloc would miss), the resident memory after it,
and its wall and CPU seconds. Linux only.

    prlimit --as=8589934592 python benchmarks/run_phases.py -- \\
        run --data fleet.parquet --methods fedprior_fixed --rounds 3 --out out -q

The phases nest (a round holds its client step); a phase's peak is measured from its own
start, so an outer phase's peak includes its inner ones'.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

ROWS: list[tuple] = []


def _status(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB → MB
    return float("nan")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


STACK: list[float] = []  # the peak so far of each open phase (outermost first)
PROCESS_PEAK = [0.0]  # ru_maxrss is reset with VmHWM: the process's peak is kept here


def _wrap(module, name: str, label: str) -> None:
    inner = getattr(module, name)

    @functools.wraps(inner)
    def wrapped(*args, **kwargs):
        # VmHWM is one counter: before resetting it for this phase, hand its value to the
        # phases that enclose this one (their peaks are carried in STACK)
        now = _status("VmHWM")
        STACK[:] = [max(p, now) for p in STACK]
        PROCESS_PEAK[0] = max(PROCESS_PEAK[0], now)
        STACK.append(0.0)
        _reset_peak()
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            peak = max(STACK.pop(), _status("VmHWM"))
            STACK[:] = [max(p, peak) for p in STACK]
            PROCESS_PEAK[0] = max(PROCESS_PEAK[0], peak)
            what = f"{label} {Path(args[0]).name}" if name == "_write_csv" else label
            ROWS.append(
                (
                    "  " * len(STACK) + what,
                    peak,
                    _status("VmRSS"),
                    time.perf_counter() - t0,
                    time.process_time() - c0,
                )
            )

    setattr(module, name, wrapped)


def _install() -> None:
    import fedcal.build as build
    import fedcal.engine.chunks as chunks
    import fedcal.engine.simulation as simulation
    import fedcal.engine.streamed as streamed
    import fedcal.experiment as experiment
    import fedcal.experiment.execute as execute
    import fedcal.experiment.record as record
    import fedcal.report.tables as tables

    _wrap(build, "load_run_data", "load (load_run_data)")
    _wrap(build, "validate_methods", "validate_methods")
    _wrap(simulation, "with_derived", "moments once (with_derived)")
    _wrap(streamed, "streamed_round", "round, streamed")
    _wrap(chunks, "client_update", "round: client step (assembled)")
    _wrap(simulation, "aggregate", "round: aggregate (assembled)")
    _wrap(simulation, "_evaluate", "evaluation")
    _wrap(simulation, "save_checkpoint", "checkpoint")
    # fedcal.experiment's steps, where each is called (the package's modules, top down)
    _wrap(execute, "simulate", "engine (simulate)")
    _wrap(record, "judge_sensors", "write: statuses (judge_sensors)")
    _wrap(record, "_write_csv", "write: a CSV")
    _wrap(execute, "_write_csv", "write: a CSV")
    _wrap(record, "save_models", "write: model.safetensors")
    _wrap(record, "export_state", "write: prior (export_state)")
    _wrap(record, "summary_row", "write: summary_row")
    _wrap(experiment, "run_experiment", "run_experiment")
    _wrap(tables, "aggregate", "report: table")


def main() -> None:
    argv = sys.argv[1:]
    if "--" in argv:
        argv = argv[argv.index("--") + 1 :]
    _install()
    from fedcal.cli import main as cli

    sys.argv = ["fedcal", *argv]
    t0, c0 = time.perf_counter(), time.process_time()
    code = 0
    try:
        cli()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        print(f"\n{'phase':48s} {'peak MB':>9s} {'RSS after':>9s} {'wall s':>8s} {'CPU s':>8s}")
        for label, peak, rss, wall, cpu in ROWS:
            print(f"{label:48s} {peak:9.0f} {rss:9.0f} {wall:8.2f} {cpu:8.2f}")
        peak = max(PROCESS_PEAK[0], _status("VmHWM"))
        print(
            f"process: peak RSS {peak:.0f}"
            f" MB, wall {time.perf_counter() - t0:.1f} s, CPU {time.process_time() - c0:.1f} s,"
            f" exit {code}, pid {os.getpid()}"
        )
    sys.exit(code)


if __name__ == "__main__":
    main()
