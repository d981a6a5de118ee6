"""fedcal's Flower app: entry points into :mod:`fedcal.apps` (engine: :mod:`fedcal.engine.flower`)."""
