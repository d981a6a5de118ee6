"""The allocator setting: applied once on glibc, never over the user's own choice."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "from fedcal.engine.memory import keep_freed_memory as k; print(k(), k())"


def probe(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_thresholds_are_set_once_on_glibc():
    assert probe() == "True True"  # the second call is the cached first


@pytest.mark.parametrize("name", ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"])
def test_the_users_environment_wins(name):
    assert probe(**{name: "131072"}) == "False False"


SIMULATE = """
from fedcal.algorithms.fedavg import FedAvg
from fedcal.core.task import Task
from fedcal.data.simulator import FleetSpec, simulate_fleet
from fedcal.engine.memory import keep_freed_memory
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal.models.mlp import MLP
before = keep_freed_memory.cache_info().currsize
fleet = prepare(simulate_fleet(FleetSpec(num_sensors=2, train_design="3x2"), seed=0))
simulate(FedAvg(Task(MLP(hidden=(4,)))), fleet, EngineConfig(rounds=1))
print(before, keep_freed_memory.cache_info().currsize)
"""


def test_simulate_applies_it():
    out = subprocess.run([sys.executable, "-c", SIMULATE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1"]
