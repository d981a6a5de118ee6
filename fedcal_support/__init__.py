"""Test and benchmark support for fedcal, kept out of the installed package.

* :mod:`fedcal_support.reference` — the idiomatic eager per-client loop (oracle of the engine);
* :mod:`fedcal_support.flower_local` — a SuperLink and SuperNodes on 127.0.0.1 (TLS, auth);
* :mod:`fedcal_support.flower_hostile` — the Flower path in one process, with hostile clients;
* :mod:`fedcal_support.fuzz_files` — the corpus of hostile fleet files;
* :mod:`fedcal_support.fewpoint_library` / :mod:`fedcal_support.direction_reference` — what
  ``studies/fewpoint_bound.py`` / ``studies/fewpoint_direction.py`` share with their tests;
* :mod:`fedcal_support.scripts` — the scripts' one command-line shape (seed lists).

Importable from a checkout: pytest puts the repository root on ``sys.path``
(``pythonpath`` in pyproject.toml); benchmarks/ and studies/ insert it themselves.
"""
