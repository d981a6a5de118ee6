"""Named presets of a method's settings: a few documented choices instead of every combination.

fedprior has 29 settings of its own (8 string switches and 2 booleans: 4,608 combinations);
a user picks one of the presets below (``[methods.fedprior_drift] preset = "field"``, or
``fedcal run --methods fedprior_drift --preset field``) and changes single settings only
where a page says why (docs/which-prior.md).

**One place for defaults.** A preset lists only the settings in which it differs from its
method's class defaults (the dataclass fields, e.g. ``FedPrior.select = "none"``); the
shipped configurations name a preset and do not repeat a setting's value
(``tests/test_presets.py`` fails on a preset key that is no setting, a value equal to the
class default, or a shipped table that repeats what its class or preset already gives).
So the class, the presets and ``default.toml`` cannot drift apart: each value is written
once.

**Precedence** (:func:`preset_settings`, applied by :func:`fedcal.build.method_settings`):
the class defaults, then the shared ``[train]`` recipe, then the preset's settings, then the
table's own keys (``[methods.<base>]`` for a variant, then ``[methods.<name>]``): an explicit
key always beats the preset. A run's ``config.json`` records the preset's name in the
method's table and every resolved value under ``resolved.methods``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any

PRESET_KEY = "preset"  # the key of a [methods.<name>] table that names a preset


@dataclass(frozen=True)
class Preset:
    """A named set of settings of ``method`` (a registered name; its subclasses take it too)."""

    method: str
    settings: Mapping[str, Any]
    use: str  # when to use it, one sentence (``fedcal methods``, docs/which-prior.md)


def _frozen(settings: dict[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(settings))


# The calibrated interval (I1–I4: residual dof, design-matched hold-out τ², rich units' own
# τ² by 5 folds) and the fleet's BIC choice of the sub-basis: what every shipped fedprior
# configuration has run with since issue 20 (docs/uncertainty.md, docs/results).
_CALIBRATED = {"select": "bic", "interval": "calibrated"}

# What travels when (issue 36.1, fedprior_rounds R1–R2): the basis chosen once the BIC choice
# stays 8 rounds (its candidates on about 2,000 units' own draws: every unit of a fleet of
# 2,000 or fewer), and the hold-out once (the last round). 8, not 3: on `make run`'s mixed
# fleet the choice led with orders (2, 3) for the first rounds and froze there after 3
# (reference units 0.0489 hPa instead of 0.0453); the early rounds' EM is not converged.
# R3 (the stop at convergence) is off: σ² converges sublinearly and a stop at 1e-4 a round
# lost a fleet's τ² (docs/benchmarks.md, "Issue 36.1").
_AT_SCALE = {"select_patience": 8, "select_units": 2000, "holdout": "final"}

PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        "chamber": Preset(
            "fedprior",
            _frozen({**_CALIBRATED, "own_folds": 5, **_AT_SCALE}),
            "a chamber-calibrated fleet without a time column (designed pressure × "
            "temperature grids; reference units and new units of a few points): the "
            "shipped default",
        ),
        "field": Preset(
            "fedprior_drift",
            _frozen(_CALIBRATED),
            "co-located field units with a time column (a calibration that ages: gain or "
            "baseline drift): each unit's coefficients walk from its last calibration "
            "point and σ grows with the time since; q = 0 (fedprior) when no drift is "
            "found or without a time column",
        ),
    }
)


class PresetError(ValueError):
    """A preset that does not exist or does not fit the method; ``str()`` is one line
    without the file: the caller names it."""


def preset_settings(name: Any, cls: type, table: str) -> dict[str, Any]:
    """The settings the preset ``name`` gives a ``[methods.<table>]`` that builds ``cls``.

    A PresetError if ``name`` is no preset, or the preset is another method's (``cls`` is
    not its method's class or a subclass of it), or it names a setting ``cls`` lacks.
    """
    if not isinstance(name, str) or name not in PRESETS:
        from fedcal.core.errors import did_you_mean

        hint = did_you_mean([str(name)], PRESETS) if isinstance(name, str) else ""
        raise PresetError(f"unknown preset {name!r}{hint}; known: {', '.join(sorted(PRESETS))}")
    preset = PRESETS[name]
    method_cls = _registry().get(preset.method)
    if method_cls is None or not (isinstance(cls, type) and issubclass(cls, method_cls)):
        built = getattr(cls, "name", getattr(cls, "__name__", cls))
        raise PresetError(
            f"preset {name!r} is for {preset.method} (and methods built on it); "
            f"[methods.{table}] builds {built}"
        )
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(preset.settings) - known)
    if unknown:
        raise PresetError(f"preset {name!r} sets {', '.join(unknown)}, not settings of {table}")
    return dict(preset.settings)


def expanded(table: Mapping[str, Any], cls: type, name: str) -> dict[str, Any]:
    """``table`` (without ``base``) with its preset replaced by the preset's settings, the
    table's own keys on top (they beat the preset)."""
    own = dict(table)
    own.pop("base", None)
    if PRESET_KEY not in own:
        return own
    chosen = own.pop(PRESET_KEY)
    return {**preset_settings(chosen, cls, name), **own}


def _registry() -> dict[str, type]:
    from fedcal.algorithms import REGISTRY

    return REGISTRY
