"""The engine's settings for every run: one definition, used by the simulator and ``[engine]``.

Torch-free, so reading a configuration does not import torch; the simulator's
:class:`~fedcal.engine.simulation.EngineConfig` adds the seed and the
aggregation policy, the configuration's ``[engine]`` the checkpoint interval.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

from pydantic import Field, PlainValidator, model_validator

from fedcal.core.hooks import WeighsOutliers
from fedcal.core.schema import MAX_CLIENTS, MAX_ROUNDS, Float, Int, Name, checked


def _auto_or_count(upper: int) -> PlainValidator:
    """A setting that is "auto" or a whole number in [1, ``upper``] (kept as given)."""

    def check(value: object) -> int | str:
        whole = isinstance(value, int) and not isinstance(value, bool)
        if value == "auto" or (whole and 1 <= value <= upper):
            return value  # type: ignore[return-value]
        raise ValueError(f'must be "auto" or an integer in [1, {upper}], got {value!r}')

    return PlainValidator(check, json_schema_input_type=int | Literal["auto"])


#: The most threads ``[engine] workers`` may name.
MAX_WORKERS = 256
#: ``[engine] eval_every``: "auto" or every k rounds (:func:`resolve_eval_every`).
EvalEvery = Annotated[int | str, _auto_or_count(MAX_ROUNDS)]
#: ``[engine] workers``: "auto" or a number of threads (:func:`resolve_workers`).
Workers = Annotated[int | str, _auto_or_count(MAX_WORKERS)]


@checked
class EngineSettings:
    """How rounds are scheduled and where they run; nothing here is an algorithm's."""

    rounds: Int = Field(default=50, ge=1, le=MAX_ROUNDS)
    participation: Float = Field(default=1.0, gt=0.0, le=1.0)  # fraction drawn each round
    # Every k rounds, the last and the one before it (the "unconverged" judgement reads the
    # last two); "auto": 1 below AUTO_EVAL_UNITS units, AUTO_EVAL_EVERY from there (an
    # evaluation of every unit costs more than a round: issue 36.1); resolve_eval_every.
    eval_every: EvalEvery = "auto"
    dtype: Literal["float32", "float64"] = "float32"
    # Clients trained and evaluated at once (0 = the whole cohort): bounds the memory of
    # local training and evaluation; the numbers do not depend on it (fedcal.engine.chunks).
    chunk_size: Int = Field(default=0, ge=0, le=MAX_CLIENTS)
    device: Name = "cpu"  # where chunks run ("cuda", "cuda:1"); the fleet's state stays on host
    # Threads computing a streamed round's chunks ("auto": the cores this process may use);
    # the numbers do not depend on it (engine/streamed.py, issue 36.1).
    workers: Workers = "auto"
    # A round whose server checks refuse more than this share of the units that replied
    # (screened by size, inconsistent, prior outliers; not a diverged unit's non-finite
    # reply) stops the run: its result would rest on the few left (1 = never; issue 36.4).
    max_rejected_share: Float = Field(default=0.5, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _device(self) -> EngineSettings:
        from fedcal.engine.chunks import resolve_device  # torch only when settings are built

        resolve_device(self.device)
        return self


# eval_every = "auto": every round below this many units, every AUTO_EVAL_EVERY rounds from
# it. At 10,000 units one evaluation of every unit took 2.6 CPU s against a round's 3.1, at
# 100,000 units 26 against 11 (docs/benchmarks.md): evaluating every round would double a
# large fleet's run or more.
AUTO_EVAL_UNITS = 10_000
AUTO_EVAL_EVERY = 10


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (no affinity call: macOS, Windows)
        return os.cpu_count() or 1


#: ``workers = "auto"`` takes at most this many threads: each holds a chunk in flight (at
#: 100,000 fedprior units in chunks of 1,000 the peak rose 2,837 → 2,867–2,985 MB from one
#: worker to two), and Python between torch's kernels is one thread's at a time. Measured
#: only on two cores; a number in the configuration is kept as given.
AUTO_WORKERS_MAX = 8


def resolve_workers(workers: int | str, cores: int) -> int:
    """``[engine] workers`` as a number of threads: itself, or ``cores`` (e.g.
    :func:`available_cores`, at most :data:`AUTO_WORKERS_MAX`) for ``"auto"``. Not torch's
    thread count: ``fedcal run`` sets that to one (its models are small), and a streamed
    round's chunks run torch on one thread each anyway."""
    if workers == "auto":
        return min(max(1, int(cores)), AUTO_WORKERS_MAX)
    return int(workers)


def resolve_eval_every(eval_every: int | str, units: int) -> int:
    """``[engine] eval_every`` as a number of rounds: itself, or for ``"auto"`` 1 below
    :data:`AUTO_EVAL_UNITS` units and :data:`AUTO_EVAL_EVERY` from there."""
    if eval_every == "auto":
        return 1 if units < AUTO_EVAL_UNITS else AUTO_EVAL_EVERY
    return int(eval_every)


class FederationRefused(RuntimeError):
    """A round in which most of the federation was refused (:func:`mostly_refused`)."""


def refused_clients(record: list[dict]) -> set[int]:
    """The clients an aggregation ``record`` says the server's checks refused: screened,
    inconsistent or a prior outlier (down-weighted), not a non-finite (diverged) reply."""
    return {int(r["client"]) for r in record if not str(r["reason"]).startswith("non-finite")}


def mostly_refused(t: int, refused: int, cohort: int, limit: float) -> None:
    """Raise :class:`FederationRefused` (one line) when ``refused`` of the ``cohort`` units
    that replied in round ``t`` (0-based) exceed the share ``limit``."""
    if cohort and refused / cohort > limit:
        raise FederationRefused(
            f"round {t + 1}: the server's checks refused {refused} of {cohort} units "
            f"({refused / cohort:.0%} > [engine] max_rejected_share = {limit:g}): most of "
            f"the federation was refused, a result would rest on the other {cohort - refused}"
        )


def unjudged(algorithm: object, metrics: dict[str, float]) -> bool:
    """Whether a round's robust M-step judged nobody: the algorithm down-weights outliers
    (``robust = "full"``) but the aggregation recorded no verdict, because the units used
    were too few to judge each against the others (at most the basis's terms + 2:
    :meth:`fedcal.algorithms.fedprior_robust.RobustUploads.outlier_weights`)."""
    judges = getattr(algorithm, "robust", None) == "full"
    judges &= isinstance(algorithm, WeighsOutliers)
    return bool(judges and metrics.get("accepted", 0.0) > 0 and "downweighted" not in metrics)
