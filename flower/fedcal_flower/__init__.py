"""fedcal's Flower app: entry points into :mod:`fedcal.apps`.

The engine is :mod:`fedcal.engine.flower`."""
