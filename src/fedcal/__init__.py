"""fedcal — personalized federated learning for calibrating fleets of sensors.

``from fedcal import FleetPrior`` is the Python API (:mod:`fedcal.api`); it is imported
on first use, so the command line does not pay for it.
"""

__version__ = "0.1.0"
__all__ = ["CalibratedUnits", "FleetPrior"]


def __getattr__(name: str):
    if name in __all__:
        from fedcal import api

        return getattr(api, name)
    raise AttributeError(f"module 'fedcal' has no attribute {name!r}")
