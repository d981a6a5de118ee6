"""Exceptions that light modules (the command line's entry) catch without importing the rest.

:class:`ConfigError` lives here, not in :mod:`fedcal.config` (which re-exports it), so that
``import fedcal.cli`` does not import the configuration schema and, through it, torch.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A configuration file or option that cannot be used; names the file and the field."""


def did_you_mean(names: Iterable[str], known: Iterable[str]) -> str:
    """``" (did you mean fedprior?)"`` for mistyped ``names`` among ``known``; "" if none is close.

    Up to two closest known names per mistyped one (:func:`difflib.get_close_matches`, its
    default cutoff 0.6 of the Ratcliff/Obershelp similarity), named after it when several
    names were mistyped: ``" (did you mean fedgmi for fedgmx, fedprior for fedprio?)"``.
    """
    known, names = sorted(set(known)), list(names)
    parts = []
    for name in names:
        close = difflib.get_close_matches(name, known, n=2)
        if close:
            parts.append(" or ".join(close) + (f" for {name}" if len(names) > 1 else ""))
    return f" (did you mean {', '.join(parts)}?)" if parts else ""
