"""The planner's forecasts through fedcal's torch path, for priors the NumPy path does not cover.

:class:`TorchForecaster` gives :mod:`fedcal.planning` what
:class:`fedcal.prior.plan.NumpyForecaster` gives it (a design's expected posterior and its
predictive variance; a unit's posterior for sequential mode), computed by ``calibrate``'s
torch path: :func:`fedcal.calibration.unit_posteriors` and fedprior's ``predictive_std``.
Used only for the variants :func:`fedcal.prior.posterior.unsupported` names (drift, the
time-respecting choice, noise over the inputs, Student-t rows), so the σ ``plan``
forecasts for them is the σ ``calibrate`` states; every other prior is planned in NumPy
(torch not needed; a prior's deployment discrepancy model too). Needs ``fedcal[neural]``.
The two agree within rounding on the priors both cover (tests/test_plan_numpy.py,
tests/prior/test_torch_free_deployed.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedcal.calibration import calibrate, prior_algorithm, prior_server, unit_posteriors
from fedcal.core.bayes import F64
from fedcal.core.data import ClientData
from fedcal.data.fleet import Fleet
from fedcal.prior.model import PriorModel
from fedcal.prior.plan import Base, Forecast


def _t(a: Any) -> torch.Tensor:
    return torch.tensor(np.asarray(a, dtype=np.float64), dtype=F64)  # a copy: may be read-only


@dataclass(frozen=True)
class TorchForecaster:
    """:class:`fedcal.prior.plan.NumpyForecaster`'s two forecasts by the torch path."""

    prior: PriorModel
    algorithm: Any = field(init=False, repr=False, compare=False)
    server: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        torch.set_num_threads(1)
        object.__setattr__(self, "algorithm", prior_algorithm(self.prior))
        # μ, Σ, σ² and the fleet's support box, as `calibrate` gives a new unit
        object.__setattr__(self, "server", prior_server(self.prior, self.prior.scaler))

    def _variance(self, params: dict):
        def variance(at: np.ndarray) -> np.ndarray:
            x = _t(at).expand(int(params["coef"].shape[0]), *at.shape)
            with torch.no_grad():
                return (self.algorithm.predictive_std(params, x)[..., 0].to(F64) ** 2).numpy()

        return variance

    def designs(self, x: np.ndarray, b: np.ndarray, count: np.ndarray, base: Base) -> Forecast:
        """Each design's expected posterior (:meth:`NumpyForecaster.designs`), formed by
        ``calibrate``'s own :func:`~fedcal.calibration.unit_posteriors`."""
        alg = self.algorithm
        c, n0 = b.shape[0], len(base.x)
        xs = torch.cat([_t(base.x).expand(c, n0, x.shape[-1]), _t(x)], 1)
        bs = torch.cat([_t(base.b).expand(c, n0), _t(b)], 1)
        coef = _t(base.coef)
        mean = (alg.design(_t(x), _t(b)) @ coef.unsqueeze(-1))[..., 0]
        ys = torch.cat([_t(base.y).expand(c, n0), mean], 1)
        data = ClientData(xs, ys.unsqueeze(-1), torch.as_tensor(count) + n0, (0,) * c, (), bs)
        with torch.no_grad():
            params = unit_posteriors(
                alg,
                self.server,
                data,
                torch.tensor(base.noise_var, dtype=F64),
                self.prior.discrepancy,
                self.prior.features,
                expected=n0 == 0,  # a new unit: the discrepancy model's scale at its expectation
            )
        declined = params.pop("declined", torch.zeros(c)) > 0  # kept aside: J scores with τ²
        p = len(alg.terms)
        if alg.branch_orders:  # E_y[m_h m_hᵀ + V_hh] = current m_h m_hᵀ + current Cov(h)
            cov = params["cov"].clone()
            cov[:, p:, p:] = _t(base.cov_h)
            params = {**params, "cov": cov, "coef": coef.expand(c, -1).clone()}
        return Forecast(
            params["coef"].numpy(), params["cov"].numpy(), declined.numpy(), self._variance(params)
        )

    def unit(self, fleet: Fleet, source: str) -> tuple[Base, Forecast]:
        """The one unit of ``fleet`` calibrated by :func:`fedcal.calibration.calibrate`."""
        with torch.no_grad():
            result = calibrate(self.prior, fleet, source)
        train, personal = result.tensors.train, result.personal
        n = int(train.count[0])
        p = len(self.algorithm.terms)
        branch = train.branch[0, :n] if train.branch is not None else torch.zeros(n, dtype=F64)
        base = Base(
            train.x[0, :n].to(F64).numpy(),
            branch.to(F64).numpy(),
            train.y[0, :n, 0].to(F64).numpy(),
            personal["coef"][0].to(F64).numpy(),
            personal["cov"][0, p:, p:].to(F64).numpy(),
            float(personal["noise_var"].reshape(-1)[0]),
        )
        declined = personal.get("declined", torch.zeros(1)) > 0
        forecast = Forecast(
            personal["coef"].numpy(), personal["cov"].numpy(), declined.numpy(),
            self._variance(personal),
        )  # fmt: skip
        return base, forecast
