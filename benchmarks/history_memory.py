"""The memory of a run's per-round history (``metrics.csv``) at a fleet's scale (issue 36.1).

Builds the history of ``--rounds`` evaluated rounds of ``--units`` units with the default
fedprior's columns (``test_``/``train_`` rmse, mae, max_abs, coverage95, pred_sd,
beyond_support in float32; status; round; rejected_rounds; the round's train_loss in float32,
loglik and jitter in float64), in one of two forms:

* ``rows`` — one dict per unit and round (``schedule.result_row`` + ``history_row``, the
  engine's form before the columns: what ``simulation._evaluate_round`` built);
* ``columns`` — one block of arrays per round (``engine.history``: ``evaluation_block`` +
  ``round_block``, what the engine builds now);

and prints, as JSON, the resident memory the history added (``/proc/self/statm`` after
the build minus before it, after a warm-up: tracemalloc, ``--tracemalloc``, misses torch's
buffers, which the columns share), per row, the seconds to build it and to make its
DataFrame (``--frame``).

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/history_memory.py --form columns \
        --units 100000 --rounds 50 --frame
"""

from __future__ import annotations

import argparse
import json
import os
import time
import tracemalloc

import numpy as np
import torch

METRICS = ("rmse", "mae", "max_abs", "coverage95", "pred_sd", "beyond_support")


def _evaluation(n: int, g: torch.Generator) -> tuple[dict, dict, torch.Tensor]:
    test = {k: torch.rand(n, generator=g, dtype=torch.float32) for k in METRICS}
    train = {k: torch.rand(n, generator=g, dtype=torch.float32) for k in METRICS}
    return test, train, torch.ones(n, dtype=torch.bool)


def _client_metrics(n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "train_loss": torch.rand(n, generator=g, dtype=torch.float32),
        "loglik": torch.rand(n, generator=g, dtype=torch.float64),
        "jitter": torch.zeros(n, dtype=torch.float64),
    }


def build_rows(n: int, rounds: int) -> list[dict]:
    """The former form: the engine's code of before the columns, line for line."""
    from fedcal.engine.schedule import history_row, result_row

    g = torch.Generator().manual_seed(0)
    ids = list(range(n))
    clients = tuple(f"S{i:06d}" for i in ids)
    rejected = torch.zeros(n, dtype=torch.int64)
    history: list[dict] = []
    for t in range(rounds):
        test, train, ok = _evaluation(n, g)
        test_l = {k: v.tolist() for k, v in test.items()}
        train_l = {k: v.tolist() for k, v in train.items()}
        rows = [
            result_row(
                i,
                cid,
                {k: v[i] for k, v in test_l.items()},
                {k: v[i] for k, v in train_l.items()},
                f,
            )
            for (i, cid), f in zip(enumerate(clients), ok.tolist(), strict=True)
        ]
        values = {name: v.tolist() for name, v in _client_metrics(n, g).items()}
        trained = {i: {name: v[j] for name, v in values.items()} for j, i in enumerate(ids)}
        history.extend(
            history_row(
                row,
                t + 1,
                int(rejected[row["client_index"]]),
                trained.get(row["client_index"], {}),
                list(values),
            )
            for row in rows
        )
    return history


def build_columns(n: int, rounds: int):
    """The engine's form now: one block of arrays per round."""
    from fedcal.engine.history import History, evaluation_block, round_block

    g = torch.Generator().manual_seed(0)
    ids = list(range(n))
    names = np.empty(n, dtype=object)
    names[:] = [f"S{i:06d}" for i in ids]
    index = np.arange(n, dtype=np.int64)
    rejected = torch.zeros(n, dtype=torch.int64)
    history = History()
    for t in range(rounds):
        test, train, ok = _evaluation(n, g)
        block = evaluation_block(index, names, test, train, ok)
        metrics = _client_metrics(n, g)
        history.add(round_block(block, t + 1, rejected.numpy().copy(), metrics, ids))
    return history


def _rss() -> int:
    """The process's resident bytes now (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--form", choices=("rows", "columns"), required=True)
    parser.add_argument("--units", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--frame", action="store_true", help="also time its DataFrame")
    parser.add_argument("--tracemalloc", action="store_true", help="also Python's allocations")
    args = parser.parse_args()
    torch.set_num_threads(1)
    build = build_rows if args.form == "rows" else build_columns
    build(10, 1)  # imports and first calls before the count: the history's bytes alone
    rss0 = _rss()
    if args.tracemalloc:
        tracemalloc.start()
    t0 = time.perf_counter()
    history = build(args.units, args.rounds)
    built = time.perf_counter() - t0
    rss = _rss() - rss0
    out = {
        "form": args.form,
        "units": args.units,
        "rounds": args.rounds,
        "rows": len(history),
        "rss_mb": round(rss / 2**20, 1),
        "rss_bytes_per_row": round(rss / max(len(history), 1), 1),
        "build_s": round(built, 2),
    }
    if args.tracemalloc:  # Python's allocations (a torch tensor's buffer is not among them)
        held, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()  # the frame's own time, not tracemalloc's
        out["traced_mb"], out["traced_peak_mb"] = round(held / 2**20, 1), round(peak / 2**20, 1)
    if args.frame:
        from fedcal.engine.history import as_frame

        t0 = time.perf_counter()
        frame = as_frame(history)
        out["frame_s"] = round(time.perf_counter() - t0, 2)
        out["frame_mb"] = round(frame.memory_usage(deep=True).sum() / 2**20, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
