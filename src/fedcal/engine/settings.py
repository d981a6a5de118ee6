"""The engine's settings for every run: one definition, used by the simulator and ``[engine]``.

Torch-free, so reading a configuration does not import torch; the simulator's
:class:`~fedcal.engine.simulation.EngineConfig` adds the seed and the
aggregation policy, the configuration's ``[engine]`` the checkpoint interval.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fedcal.core.schema import MAX_CLIENTS, MAX_ROUNDS, Float, Int, Name, checked


@checked
class EngineSettings:
    """How rounds are scheduled and where they run; nothing here is an algorithm's."""

    rounds: Int = Field(default=50, ge=1, le=MAX_ROUNDS)
    participation: Float = Field(default=1.0, gt=0.0, le=1.0)  # fraction drawn each round
    eval_every: Int = Field(default=1, ge=1, le=MAX_ROUNDS)  # every k rounds, and the last
    dtype: Literal["float32", "float64"] = "float32"
    # Clients trained and evaluated at once (0 = the whole cohort): bounds the memory of
    # local training and evaluation; the numbers do not depend on it (fedcal.engine.chunks).
    chunk_size: Int = Field(default=0, ge=0, le=MAX_CLIENTS)
    device: Name = "cpu"  # where chunks run ("cuda", "cuda:1"); the fleet's state stays on host

    @model_validator(mode="after")
    def _device(self) -> EngineSettings:
        from fedcal.engine.chunks import resolve_device  # torch only when settings are built

        resolve_device(self.device)
        return self
