"""kill -9 a run at a random moment, start it again, compare with an uninterrupted run.

Each trial starts ``fedcal``'s experiment (FedGMI, 3 toy sensors, checkpoint
every round) in a subprocess, sends SIGKILL after a random delay once the
first checkpoint exists, reruns the same command to completion, and compares
done.json (without wall time), metrics.csv, per_sensor.csv and every model
tensor with the uninterrupted run. Prints one line per trial and the count.

    python benchmarks/kill_resume.py [--trials 20] [--rounds 80] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

SCRIPT = """
import sys
from dataclasses import replace
import torch
torch.set_num_threads(1)
from fedcal.config import default_config
from fedcal.data.loader import load_fleet
from fedcal.experiment import run_experiment
cfg = default_config()
cfg = replace(cfg, seeds=1,
              engine=replace(cfg.engine, rounds=int(sys.argv[3]), checkpoint_every=1),
              model=replace(cfg.model, hidden=(8, 8)),
              train=replace(cfg.train, local_epochs=1))
run_experiment(cfg, load_fleet(sys.argv[1]), sys.argv[2], ["fedgmi"])
"""


def toy_frame(seed: int = 0, sensors: int = 3, points: int = 30) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for s in range(sensors):
        f0 = rng.normal(33_000, 150)
        for i in range(points):
            p, t = rng.uniform(50, 1550), rng.uniform(-40, 60)
            split = "test" if i % 6 == 5 else "train"
            rows.append((f"S{s:02d}", f0 + 2.3 * p + 0.4 * t, t, p, split))
    columns = ["sensor_id", "frequency_hz", "temperature_c", "pressure_hpa", "split"]
    return pd.DataFrame(rows, columns=columns)


def start(data: Path, out: Path, rounds: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SCRIPT, str(data), str(out), str(rounds)])


def outputs(out: Path) -> dict:
    from fedcal.core.tensorfile import load_trees

    run = out / "runs" / "fedgmi_tp0_seed0"
    summary = json.loads((run / "done.json").read_text())
    summary.pop("wall_s")
    trees, _, _ = load_trees(run / "model.safetensors")
    return {
        "summary": summary,
        "metrics": pd.read_csv(run / "metrics.csv"),
        "per_sensor": pd.read_csv(run / "per_sensor.csv"),
        "params": dict(trees["params"]),
    }


def same(a: dict, b: dict) -> bool:
    return (
        a["summary"] == b["summary"]
        and a["metrics"].equals(b["metrics"])
        and a["per_sensor"].equals(b["per_sensor"])
        and a["params"].keys() == b["params"].keys()
        and all(a["params"][k].equal(b["params"][k]) for k in a["params"])
    )


def main() -> None:
    from fedcal.core.tensorfile import load_trees
    from fedcal.data.fleet import Fleet
    from fedcal.data.loader import save_fleet

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = root / "fleet.csv"
        save_fleet(Fleet(toy_frame()), data)
        assert start(data, root / "straight", args.rounds).wait() == 0
        reference = outputs(root / "straight")
        identical = 0
        for trial in range(args.trials):
            out = root / f"trial{trial}"
            ckpt = out / "runs" / "fedgmi_tp0_seed0" / "checkpoint.safetensors"
            proc = start(data, out, args.rounds)
            while proc.poll() is None and not ckpt.exists():
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 1.5))
            if proc.poll() is not None:
                print(f"trial {trial}: finished before the kill; not counted")
                continue
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            at = load_trees(ckpt)[1]["round"]
            code = start(data, out, args.rounds).wait()
            ok = code == 0 and same(reference, outputs(out))
            identical += ok
            print(
                f"trial {trial}: killed after checkpoint of round {at}: "
                f"{'identical' if ok else 'DIFFERENT'}"
            )
        print(f"identical after kill -9: {identical} of {args.trials}")


if __name__ == "__main__":
    main()
