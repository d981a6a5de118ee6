"""Where a run's messages go: the caller's callbacks (the CLI prints them, the API collects
them), each optional."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Hooks:
    """``on_progress(label, round, stats)``, ``on_skip(method, reason)``, ``on_fail(label,
    reason)``, ``on_note(method, message)``, ``on_status(label, message)``; None: not said."""

    on_progress: Callable[[str, int, dict], None] | None = None
    on_skip: Callable[[str, str], None] | None = None
    on_fail: Callable[[str, str], None] | None = None
    on_note: Callable[[str, str], None] | None = None
    on_status: Callable[[str, str], None] | None = None

    def skip(self, method: str, reason: str) -> None:
        _say(self.on_skip, method, reason)

    def fail(self, label: str, reason: str) -> None:
        _say(self.on_fail, label, reason)

    def note(self, method: str, message: str) -> None:
        _say(self.on_note, method, message)

    def status(self, label: str, message: str) -> None:
        _say(self.on_status, label, message)

    def progress(self, label: str) -> Callable[[int, dict], None] | None:
        """The engine's per-round callback for run ``label`` (None: no progress wanted)."""
        if self.on_progress is None:
            return None
        on_progress = self.on_progress
        return lambda t, s: on_progress(label, t, s)


def _say(callback: Callable[..., None] | None, *args: str) -> None:
    if callback is not None:
        callback(*args)
