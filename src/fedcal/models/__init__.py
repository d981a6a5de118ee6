"""Model families with a named feature-extractor / head split.

The package imports no torch itself: the stored prior's check reads the basis registry
(:mod:`fedcal.models.families`) on a calibration station without torch; the models are
imported where one is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedcal.core.task import Model

FAMILIES = ("mlp", "basis", "classifier")


def build_model(
    family: str,
    in_features: int,
    out_features: int,
    hidden: tuple[int, ...] = (64, 64),
    activation: str = "tanh",
    poly_orders: tuple[int, ...] = (3, 3),
    poly_domain: tuple[tuple[float, float], ...] | None = None,
) -> Model:
    """A model of the named family (see each module for its design).

    ``poly_orders`` (one Legendre order per input) and ``poly_domain`` (the
    scaled interval of each input mapped onto [-1, 1]) are read by ``"basis"`` only.
    """
    from fedcal.models.basis import Basis
    from fedcal.models.classifier import HypersphereClassifier
    from fedcal.models.mlp import MLP

    if family == "mlp":
        return MLP(in_features, tuple(hidden), out_features, activation)
    if family == "basis":
        return Basis(
            in_features, tuple(poly_orders), tuple(hidden), out_features, activation, poly_domain
        )
    if family == "classifier":
        # out_features = number of classes; hidden = encoder widths
        return HypersphereClassifier(in_features, tuple(hidden), num_classes=out_features)
    raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
