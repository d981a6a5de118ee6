"""The schedule of a run, shared by the simulator and the Flower engine.

Which clients train in round ``t`` (:func:`cohort`), which rounds are
evaluated (:func:`evaluates`), the seeds each client draws
(:func:`train_seeds`, :func:`personalize_seeds`; functions of run seed, round
and client index only, so a client gets the same seeds whatever else runs
beside it) and the shape of the result rows (:func:`result_row`,
:func:`history_row`, :func:`final_row`). Both engines call these, so a Flower
run and a simulation cannot drift apart.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from fedcal.core.data import PERSONALIZE, TRAIN, client_round_seed
from fedcal.status import Status

# what :func:`fedcal.engine.evaluation.interval_metrics` adds: NaN where no interval is stated
INTERVAL_METRICS = ("coverage95", "pred_sd")


def cohort(seed: int, round_index: int, num_clients: int, participation: float) -> Tensor:
    """Sorted indices of the clients taking part in a round."""
    if participation >= 1.0:
        return torch.arange(num_clients)
    k = max(1, round(participation * num_clients))
    rng = np.random.default_rng(np.random.SeedSequence([seed, round_index, 7]))
    return torch.as_tensor(np.sort(rng.choice(num_clients, size=k, replace=False)))


def evaluates(t: int, rounds: int, eval_every: int | str, units: int = 0) -> bool:
    """Whether round ``t`` (0-based) is evaluated: every ``eval_every`` rounds ("auto": by
    the fleet's ``units``, :func:`~fedcal.engine.settings.resolve_eval_every`), the last and
    the one before it — the "unconverged" judgement reads each unit's train error in the
    last two evaluated rounds (:func:`fedcal.status.still_improving`), so with any
    ``eval_every`` it reads the same two rounds as when every round is evaluated (issue
    36.1). A run its algorithm ends early (``EndsRounds``) has its round before the last
    scored late by the simulator."""
    from fedcal.engine.settings import resolve_eval_every

    return t >= rounds - 2 or (t + 1) % resolve_eval_every(eval_every, units) == 0


def train_seeds(seed: int, t: int, indices: Iterable[int]) -> tuple[int, ...]:
    """The clients' minibatch seeds of round ``t``."""
    return tuple(client_round_seed(seed, t, int(i), TRAIN) for i in indices)


def personalize_seeds(seed: int, t: int, indices: Iterable[int]) -> tuple[int, ...]:
    """The clients' seeds for ``personalize`` after round ``t``."""
    return tuple(client_round_seed(seed, t, int(i), PERSONALIZE) for i in indices)


def result_row(
    client_index: int,
    client: str,
    test: Mapping[str, float],
    train: Mapping[str, float],
    model_finite: bool,
) -> dict:
    """One client's evaluation row: ``test_*``/``train_*`` metrics and its status.

    Diverged: a non-finite personalized model or test error (a train error may
    overflow on absurd labels while the model itself is fine; a declined interval's NaN
    coverage is not an error).
    """
    row: dict = {"client_index": client_index, "client": client}
    row.update({f"test_{k}": float(v) for k, v in test.items()})
    row.update({f"train_{k}": float(v) for k, v in train.items()})
    # An interval the method declines to state (NaN coverage95/pred_sd) is no divergence.
    errs = [v for k, v in test.items() if k not in INTERVAL_METRICS]
    finite = model_finite and all(math.isfinite(float(v)) for v in errs)
    row["status"] = str(Status.OK if finite else Status.DIVERGED)
    return row


def history_row(
    evaluation: Mapping,
    round_number: int,
    rejected_rounds: int,
    trained: Mapping[str, float],
    names: Sequence[str],
) -> dict:
    """A client's row of the per-round history (``metrics.csv``).

    Its evaluation row (:func:`result_row`) after round ``round_number`` (1-based), the
    rounds its reply was rejected so far, and the round's client metrics ``names``
    (train loss, FedGMI's α, …) from ``trained``: NaN for a client that sat the round out.
    """
    row = {**evaluation, "round": round_number, "rejected_rounds": rejected_rounds}
    row.update({name: trained.get(name, float("nan")) for name in names})
    return row


def final_row(evaluation: Mapping, rejected_rounds: int) -> dict:
    """A client's row of the final table (``per_sensor.csv``): its evaluation row after the
    last round (:func:`result_row`) and the rounds its reply was rejected; no per-round
    columns (round, the round's client metrics)."""
    return {**evaluation, "rejected_rounds": rejected_rounds}
