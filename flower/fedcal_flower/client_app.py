"""ClientApp component (see fedcal.apps.flower_client)."""

from fedcal.apps.flower_client import app

__all__ = ["app"]
