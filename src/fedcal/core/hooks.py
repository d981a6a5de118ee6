"""Optional hooks of one algorithm family (the fleet prior's), as protocols the engine tests.

The :class:`~fedcal.core.algorithm.Algorithm` base declares the hooks most algorithms use;
these are fedprior's alone (issue 35), so the base does not declare them: an algorithm that
has one defines its methods, and the engine asks ``isinstance(algorithm, Protocol)`` before
it calls them (runtime-checkable protocols: the methods' presence; a subclass that sets one
to ``None`` opts out). Imports nothing of fedcal but the tree type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

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
