"""Hostile fedprior sites for tests and studies/prior_attack.py (issue 21; not shipped).

A site that scales every statistic of its fedprior upload by a factor — the posterior
means, second moments, GLS terms, RSS, every candidate's, the interval's sums — but not its
row count ``n`` and Gram (a count check alone would catch those), in the simulator
(:class:`ScaledSites`) or on a Flower reply (:func:`scale_arrays`, and as a tamper hook of
the in-process Flower transport: :func:`scaling_site`); and a unit whose training targets
are flipped (:func:`flipped`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from fedcal.algorithms.fedprior import FedPrior
from fedcal.core.algorithm import ClientResult

# the interval's probe design (inputs, directions, rows) is not a statistic: left as sent
NOT_SCALED = ("n", "gram", "interval/x", "interval/b", "interval/n")


@dataclasses.dataclass(frozen=True)
class ScaledSites(FedPrior):
    """fedprior whose clients ``attackers`` (cohort positions) scale their upload by
    ``factor`` (every leaf but :data:`NOT_SCALED`). Needs the whole fleet in one cohort
    (chunk_size 0, full participation)."""

    attackers: tuple[int, ...] = ()
    factor: float = 1.0

    def client_update(self, down, state, data) -> ClientResult:
        out = super().client_update(down, state, data)
        scale = torch.ones(data.mask.shape[0], dtype=torch.float64)
        scale[list(self.attackers)] = self.factor
        return ClientResult(_scaled(out.reply, scale), out.state, out.metrics)


def attacking(algorithm: FedPrior, attackers: tuple[int, ...], factor: float, **kw) -> ScaledSites:
    """``algorithm``'s settings (and ``kw``) with clients ``attackers`` scaling by ``factor``."""
    params = {f.name: getattr(algorithm, f.name) for f in dataclasses.fields(algorithm)}
    return ScaledSites(**{**params, **kw}, attackers=tuple(attackers), factor=float(factor))


def _scaled(tree, scale, prefix=""):
    out = {}
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict):
            out[k] = _scaled(v, scale, path + "/")
        elif path in NOT_SCALED or not v.is_floating_point():
            out[k] = v
        else:
            out[k] = v * scale.reshape(-1, *([1] * (v.dim() - 1))).to(v.dtype)
    return out


def scale_arrays(arrays: dict[str, np.ndarray], factor: float) -> dict[str, np.ndarray]:
    """One Flower reply's arrays (flattened keys) with every statistic scaled by ``factor``."""
    return {
        k: v if k in NOT_SCALED or not np.issubdtype(v.dtype, np.floating) else v * factor
        for k, v in arrays.items()
    }


def scaling_site(attacker: int, factor: float):
    """A tamper hook (:class:`~fedcal_support.flower_hostile.InProcess`): client
    ``attacker``'s fedprior upload scaled by ``factor`` (:func:`scale_arrays`), every other
    message as sent."""
    from fedcal_support.flower_hostile import arrays, with_arrays

    def hostile(t, i, part):
        if i != attacker or "reply" not in part:
            return part
        return with_arrays(part, scale_arrays(arrays(part), factor))

    return hostile


def flipped(fleet, unit: str):
    """The fleet with ``unit``'s training targets p → 1600 − p (test rows untouched)."""
    frame = fleet.frame.copy()
    rows = (frame[fleet.client_column] == unit) & (frame["split"] == "train")
    frame.loc[rows, fleet.target] = 1600.0 - frame.loc[rows, fleet.target]
    return dataclasses.replace(fleet, frame=frame)
