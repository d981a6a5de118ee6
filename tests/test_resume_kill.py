"""A run killed with SIGKILL mid-way resumes to exactly the numbers of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from fedcal.core.tensorfile import load_trees
from fedcal.data.loader import save_fleet

SRC = str(Path(__file__).resolve().parents[1] / "src")
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
              train=replace(cfg.train, local_epochs=1),
              unconverged_tol=1.0)  # every sensor ok: the summary's means are numbers to compare
run_experiment(cfg, load_fleet(sys.argv[1]), sys.argv[2], ["fedgmi"])
"""
ROUNDS = 80


def start(data: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(data), str(out), str(ROUNDS)], env=env
    )


def outputs(out: Path) -> dict:
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


def test_kill_9_then_rerun_gives_identical_results(tmp_path, make_fleet):
    data = tmp_path / "fleet.csv"
    save_fleet(make_fleet(num_clients=3), data)
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert start(data, straight).wait(timeout=600) == 0

    proc = start(data, killed)
    ckpt = killed / "runs" / "fedgmi_tp0_seed0" / "checkpoint.safetensors"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if ckpt.exists() and load_trees(ckpt)[1]["round"] >= 5:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    round_killed = load_trees(ckpt)[1]["round"]  # the checkpoint is intact after the kill
    assert 5 <= round_killed < ROUNDS
    assert not (ckpt.parent / "done.json").exists()

    assert start(data, killed).wait(timeout=600) == 0
    a, b = outputs(straight), outputs(killed)
    assert a["summary"] == b["summary"]
    pd.testing.assert_frame_equal(a["metrics"], b["metrics"])
    pd.testing.assert_frame_equal(a["per_sensor"], b["per_sensor"])
    assert a["params"].keys() == b["params"].keys()
    assert all(a["params"][k].equal(b["params"][k]) for k in a["params"])
    assert not ckpt.exists()
