"""The deployment discrepancy model of a fleet larger than its emulating references
(fedprior_deploy E1: at most MAX_REFERENCES units emulate, evenly chosen).

Only the references emulate, so only their uploads are summed: every unit's, zero rows
for the others, were (units, knots, ν₀, κ) arrays — 13.5 GB at 100,000 units, the peak of
`fedcal run` (issue 36). The model learned from the references' sums must be the one the
every-unit sums gave, within the rounding of summing zeros in another order.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedcal.algorithms import fedprior_deploy as deploy
from fedcal.core.bayes import F64
from fedcal.core.data import ClientData

from .test_fedprior_deploy import _reference_data, deployment  # noqa: F401  (the fixture)

REFERENCES = 6  # MAX_REFERENCES for the test (64 ship: the same rule, 10× the time)
UNITS = REFERENCES + 3  # more units than emulate: 3 of them upload nothing


def _fleet(data: ClientData) -> ClientData:
    """UNITS reference units: the fixture's 4 campaign units, each repeated."""
    k = data.num_clients
    units = [
        (
            data.x[i % k, : int(data.count[i % k])].numpy(),
            data.y[i % k, : int(data.count[i % k])].numpy(),
        )
        for i in range(UNITS)
    ]
    return ClientData.from_arrays(units, dtype=F64)


def _close(a, b, path: str = "") -> None:
    """Equal structure; numbers within 1e-12 relative (the sums' rounding)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _close(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-12, abs=0.0) or (math.isinf(a) and a == b), path
    else:
        assert a == b, path


def test_only_the_references_uploads_are_summed(deployment, monkeypatch):  # noqa: F811
    prior, _, _ = deployment
    alg, server, data = _reference_data(prior)
    fleet = _fleet(data)
    monkeypatch.setattr(deploy, "MAX_REFERENCES", REFERENCES)
    refs = torch.linspace(0, UNITS - 1, REFERENCES).round().long()
    sizes: list[int] = []
    real_per_unit, real_reliance = deploy._per_unit, deploy.reliance_sums

    def spied(values, unit, units):
        sizes.append(units)
        return real_per_unit(values, unit, units)

    monkeypatch.setattr(deploy, "_per_unit", spied)
    monkeypatch.setattr(
        deploy,
        "reliance_sums",
        lambda em, gram, units: sizes.append(units) or real_reliance(em, gram, units),
    )
    model = alg.deploy_state(server, fleet)
    assert model is not None and model["units"] == REFERENCES
    assert sizes and set(sizes) == {REFERENCES}  # never one row per fleet unit

    # the sums of before: a row for every unit of the fleet, zeros where none emulates
    def every_unit(values, unit, units):
        return real_per_unit(values, refs[unit], UNITS)

    def every_reliance(em, gram, units):
        return real_reliance({**em, "unit": refs[em["unit"]]}, gram, UNITS)

    monkeypatch.setattr(deploy, "_per_unit", every_unit)
    monkeypatch.setattr(deploy, "reliance_sums", every_reliance)
    _close(model, alg.deploy_state(server, fleet))
