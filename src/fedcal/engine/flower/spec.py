"""A built algorithm as data: what the server sends every site once, in the handshake.

The server cannot build the :class:`~fedcal.core.algorithm.Algorithm` itself before
the handshake (the model's width is the sites' feature count), and a site must
build exactly the same one without the application's configuration. So the engine
carries a specification: the registered algorithm, the field values it is built
with (as the application validated them), and the model of its task.
:meth:`AlgorithmSpec.build` turns it back into an Algorithm once the data shape is
known — on the server after the handshake, on each site for every round message.

It travels as JSON in the handshake (:meth:`~AlgorithmSpec.to_json`); a site keeps
it next to its state for the run (:mod:`~fedcal.engine.flower.client`). Field
values keep their Python types exactly (a tuple stays a tuple, a list a list), so
the site's algorithm equals the server's field for field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedcal.core.algorithm import Algorithm

_TUPLE = "__tuple__"  # JSON has only lists: a tuple travels as {"__tuple__": [...]}


def _encode(value: Any) -> Any:
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {_TUPLE}:
            return tuple(_decode(v) for v in value[_TUPLE])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


@dataclass(frozen=True)
class ModelSpec:
    """The model of the task (:func:`fedcal.models.build_model`) and its head split."""

    family: str = "mlp"
    hidden: tuple[int, ...] = (64, 64)
    activation: str = "tanh"
    poly_orders: tuple[int, ...] = (3, 3)
    head_layers: int = 1


@dataclass(frozen=True)
class AlgorithmSpec:
    """A registered algorithm, its field values and its model: enough to rebuild it anywhere.

    ``method`` is the run's name for it (a configured variant's own name), ``algorithm``
    the registered class it builds (what a node's policy judges).
    """

    method: str
    algorithm: str
    params: Mapping[str, Any] = field(default_factory=dict)
    model: ModelSpec = field(default_factory=ModelSpec)

    def build(self, num_features: int, num_classes: int = 0) -> Algorithm:
        """The algorithm for ``num_features`` inputs; ``num_classes`` > 0: a classification task."""
        from fedcal.algorithms import get
        from fedcal.core.classification import ClassificationTask
        from fedcal.core.task import Task
        from fedcal.models import build_model

        m = self.model
        out = num_classes if num_classes else 1
        model = build_model(m.family, num_features, out, m.hidden, m.activation, m.poly_orders)
        kind = ClassificationTask if num_classes else Task
        return get(self.algorithm)(task=kind(model, head_layers=m.head_layers), **self.params)

    def to_json(self) -> str:
        return json.dumps(_encode(asdict(self)), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> AlgorithmSpec:
        """Inverse of :meth:`to_json`; malformed text is a ValueError saying so."""
        try:
            raw = _decode(json.loads(text))
            model = ModelSpec(**raw["model"])
            return cls(raw["method"], raw["algorithm"], dict(raw["params"]), model)
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"not an algorithm specification: {err}") from None
