"""ServerApp component (see fedcal.apps.flower_server)."""

from fedcal.apps.flower_server import app

__all__ = ["app"]
