"""Applications above the engine: they read a configuration and run the engine.

:mod:`~fedcal.apps.flower_server` / :mod:`~fedcal.apps.flower_client` are the Flower
``ServerApp`` / ``ClientApp`` (named by ``flower/pyproject.toml``); the command line
is :mod:`fedcal.cli`.
"""
