"""Shared fixtures: small fleets that need no simulator, float64 for exact comparisons."""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest

from fedcal.data.fleet import Fleet

try:
    import torch
except ImportError:  # the core install (no torch): CI runs tests/prior/test_torch_free.py there
    torch = None
else:
    torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    """pytest-xdist's workers run with COLUMNS=80 set: a rich Console built at import
    (fedcal.cli's, imported at collection, after this) would fix its width to it, and
    tests that invoke the CLI with a wide terminal (CliRunner(env={"COLUMNS": ...})) would
    see wrapped tables. Unset, the width is read at each print, as in one process."""
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)


def toy_fleet(
    num_clients: int = 4, train: int | list[int] = 24, test: int = 6, seed: int = 0
) -> Fleet:
    """Sensors whose frequency is an affine-plus-curvature map of (P, T), different per sensor."""
    rng = np.random.default_rng(seed)
    counts = train if isinstance(train, list) else [train] * num_clients
    rows = []
    for c, n in enumerate(counts):
        f0, k, tc = rng.normal(33_000, 150), rng.normal(2.3, 0.2), rng.normal(0.4, 0.2)
        for split, m in (("train", n), ("test", test)):
            p = rng.uniform(50, 1550, m)
            t = rng.uniform(-40, 60, m)
            f = f0 + k * p + tc * t + 2e-4 * p * t - 1e-4 * p**2
            rows += [(f"S{c:02d}", fi, ti, pi, split) for fi, ti, pi in zip(f, t, p, strict=True)]
    frame = pd.DataFrame(
        rows, columns=["sensor_id", "frequency_hz", "temperature_c", "pressure_hpa", "split"]
    )
    return Fleet(frame)


@pytest.fixture
def fleet() -> Fleet:
    return toy_fleet()


@pytest.fixture(scope="session")
def make_fleet():
    """The :func:`toy_fleet` factory, for tests that need other sizes."""
    return toy_fleet


def stored_prior(doc: dict):
    """A :class:`fedcal.prior.model.PriorModel` of an algorithm's ``export_state`` plus the
    context a run adds (defaults: method fedprior, target ``y``, the identity scaler)."""
    from fedcal.prior.model import PriorModel

    identity = {"x_offset": [0.0] * len(doc["features"]), "x_scale": [1.0] * len(doc["features"])}
    context = {
        "method": "fedprior",
        "method_params": {},
        "target": "y",
        "scaler": {**identity, "y_offset": [0.0], "y_scale": [1.0], "sources": {}},
    }
    return PriorModel.from_dict({**context, **doc}, "prior.json")
