"""Optional hooks of one algorithm family (the fleet prior's), as protocols the engine tests.

The :class:`~fedcal.core.algorithm.Algorithm` base declares the hooks most algorithms use;
these are fedprior's alone (issue 35), so the base does not declare them: an algorithm that
has one defines its methods, and the engine asks ``isinstance(algorithm, Protocol)`` before
it calls them (runtime-checkable protocols: the methods' presence; a subclass that sets one
to ``None`` opts out), or calls the helper functions here (:func:`with_scaler`,
:func:`unit_columns`, :func:`labelled_units`) that do. Imports nothing of fedcal but the tree
type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np
from torch import Tensor

from fedcal.core.tree import Tree


@runtime_checkable
class StreamsSums(Protocol):
    """A "sum" server update that runs from Σ_i reply_i and the unit count alone, so the
    engine may stream a round chunk by chunk (engine/streamed.py; fedprior).

    ``server_update_sums(server, sums, count)``: the server update from the sums;
    ``streaming_refused()``: why not for these settings, or None; ``outlier_inputs``: the
    reply leaves ``outlier_weights`` reads per unit (kept when streaming);
    ``picked_leaves``: reply leaves that are one client's, not summed, taken from the used
    client ``pick_reply(keys)`` names (None: zeros), ``keys`` its ``pick_inputs`` kept per
    client (fedprior's calibrated-interval probe: an arg-min, not a sum)."""

    outlier_inputs: tuple[str, ...]
    picked_leaves: tuple[str, ...]
    pick_inputs: tuple[str, ...]

    def server_update_sums(self, server: Tree, sums: Tree, count: Tensor) -> Tree: ...

    def streaming_refused(self) -> str | None: ...

    def pick_reply(self, keys: Tree) -> int | None: ...


@runtime_checkable
class BindsConsistency(Protocol):
    """``consistency_check(server)`` -> ``check(replies, weights, accepted)``: the algorithm's
    ``inconsistent_replies`` bound to one round's server, its per-round pieces formed once (a
    streamed round calls it once per chunk); without it the engine binds
    ``inconsistent_replies`` itself."""

    def consistency_check(self, server: Tree) -> Callable[..., dict[int, str] | None]: ...


@runtime_checkable
class TimedStd(Protocol):
    """``predictive_std_timed(params, data)`` -> (clients, rows, 1): σ at each row's time,
    for a model whose uncertainty grows after calibration (fedprior_drift); evaluation uses
    it instead of ``predictive_std``."""

    def predictive_std_timed(self, params: Tree, data: Any) -> Tensor: ...


@runtime_checkable
class DerivesData(Protocol):
    """``derive(data)`` -> {name: (clients, ...) tensor} | None: per-client tensors that
    depend on the clients' data alone (fedprior's moments), formed once by the engine and
    passed back as ``ClientData.derived`` every round; ``client_update`` gives the same result
    without them. A subclass sets ``derive = None`` to opt out."""

    def derive(self, data: Any) -> dict[str, Tensor] | None: ...


@runtime_checkable
class EndsRounds(Protocol):
    """An algorithm that schedules its own rounds (fedprior's, issue 36.1): before round ``t``
    of a run capped at ``rounds`` over ``units`` clients the engine passes the server through
    ``before_round(server, t, rounds, units)`` (fedprior: the last round holds out its
    interval's rows; the candidates' sample rate from the fleet's size); after a round's
    server update ``finished(server)`` says the run is done (the engine evaluates and stops
    there)."""

    def finished(self, server: Tree) -> bool: ...

    def before_round(self, server: Tree, t: int, rounds: int, units: int) -> Tree: ...


def before_round(algorithm: Any, server: Tree, t: int, rounds: int, units: int) -> Tree:
    """``server`` through ``algorithm.before_round`` for a training round ``t < rounds`` of
    an algorithm that schedules its rounds (:class:`EndsRounds`); else unchanged."""
    if t >= rounds or not isinstance(algorithm, EndsRounds):
        return server
    return algorithm.before_round(server, t, rounds, units)


@runtime_checkable
class DeclaresStatistics(Protocol):
    """``dp_statistics(down)`` -> {reply path: :class:`fedcal.core.privacy.Statistic`}: a
    "sum" server's statistics, each with its public map and bound, so client-level DP clips
    and noises them one by one (core/stages.private_statistics; fedprior). Without it: one
    joint clip bound. A subclass sets ``dp_statistics = None`` to opt out."""

    def dp_statistics(self, down: Tree) -> dict: ...


@runtime_checkable
class WeighsOutliers(Protocol):
    """``outlier_weights(server, replies)`` -> :class:`fedcal.core.robust.OutlierWeights` or
    None: the M-step weight of each used client (fedprior's ``robust = "full"``); those
    below 1/2 are reported as down-weighted (core/aggregation)."""

    def outlier_weights(self, server: Tree, replies: Tree) -> Any: ...


@runtime_checkable
class UnitColumns(Protocol):
    """``unit_columns(personal, train)`` -> {column: (clients,) values}: extra per-unit
    outputs written to per_sensor.csv and units.csv (fedprior_drift's ``recalibrate_at``,
    fedprior_choice's ``fallback``); ``unit_labels``: {column: names} for a column sent as a
    number (a Flower reply carries numbers only) that the tables write as names[code]."""

    unit_labels: dict[str, tuple[str, ...]]

    def unit_columns(self, personal: Tree, train: Any) -> dict: ...


@runtime_checkable
class StatusValues(Protocol):
    """``status_values(personal, x, mask)`` -> {name: (clients,) values}: per-unit values that
    ``client_status`` compares with the fleet's median (fedprior_choice's implausible rule).
    A caller that judges the units in chunks passes the medians over every unit
    (:func:`fedcal.core.algorithm.fleet_medians`) as ``server["status_medians"]``."""

    def status_values(self, personal: Tree, x: Tensor, mask: Tensor) -> dict: ...


@runtime_checkable
class ReadsScaler(Protocol):
    """``with_scaler(scaler)``: the algorithm told the run's scaler, for settings stated in
    data units (fedprior's raw reading, ``raw_map``); the simulator, ``calibrate`` and both
    sides of a Flower run pass every algorithm through :func:`with_scaler`."""

    def with_scaler(self, scaler: Any) -> Any: ...


def with_scaler(algorithm: Any, scaler: Any) -> Any:
    """``algorithm`` told the run's scaler (:class:`ReadsScaler`); else unchanged."""
    return algorithm.with_scaler(scaler) if isinstance(algorithm, ReadsScaler) else algorithm


def unit_columns(algorithm: Any, personal: Tree, train: Any) -> dict:
    """The algorithm's per-unit columns (:class:`UnitColumns`), or {} without any."""
    return algorithm.unit_columns(personal, train) if isinstance(algorithm, UnitColumns) else {}


def labelled_units(algorithm: Any, columns: dict) -> dict:
    """``columns`` with each ``unit_labels`` column of the algorithm as names (codes sent as
    numbers: names[code]); unchanged for an algorithm without labels."""
    out = dict(columns)
    for name, labels in getattr(algorithm, "unit_labels", {}).items():
        if name in out:
            codes = np.asarray(out[name], dtype=float).astype(int)
            out[name] = np.asarray(labels, dtype=object)[codes]
    return out
