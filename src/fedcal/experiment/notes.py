"""What the run output says about a finished run, one line each: sensors not ok and
rejected replies, weakly identified prior directions, the time-respecting choice, Gram
jitter, rounds the robust M-step could not judge.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from fedcal.core.aggregation import is_downweighting
from fedcal.status import NOT_OK


def status_notes(final: pd.DataFrame, rejections: pd.DataFrame, limit: int = 10) -> list[str]:
    """What the run output says about a finished run's sensors: one line per status that is
    not ok (how many, which), and one per rejected client (rounds, reason, ratio vs
    threshold), at most ``limit`` clients named (the rest are in rejections.csv)."""
    notes = []
    status = final["status"].astype(str)
    for name in NOT_OK:  # most severe first
        which = final.loc[status == name, "client"].astype(str).tolist()
        if which:
            shown = ", ".join(which[:limit]) + (
                f" and {len(which) - limit} more" * (len(which) > limit)
            )
            notes.append(
                f"{len(which)} of {len(final)} sensor(s) {name}, excluded from the means: {shown}"
                " (status_reason in per_sensor.csv)"
            )
    if rejections.empty:
        return notes
    lowered = rejections["reason"].map(is_downweighting)
    for part, verb in ((rejections[~lowered], "rejected"), (rejections[lowered], "down-weighted")):
        groups = list(part.groupby("client", sort=False))
        for client, rows in groups[:limit]:
            last = rows.iloc[-1]
            rounds = rows["round"].astype(int)
            size = (
                f": size {float(last['ratio']):.3g} > threshold {float(last['threshold']):g}"
                if last["reason"] == "size"
                else f": {last['reason']}"
            )
            span = f"{rounds.min()}–{rounds.max()}" if rounds.max() > rounds.min() else rounds.min()
            notes.append(
                f"server {verb} {client}'s reply in {len(rows)} round(s) ({span}){size}"
                + (" (still aggregated)" if verb == "down-weighted" else "")
            )
        if len(groups) > limit:
            notes.append(f"… and {len(groups) - limit} more client(s) {verb} (rejections.csv)")
    return notes


def identification_note(state: dict[str, Any]) -> str:
    """A one-line warning when the fleet's data leave directions of a prior unlearned."""
    ident = state.get("identification") or {}
    weak = ident.get("weak_directions", 0)
    if not weak:
        return ""
    return (
        f"the fleet's calibration points do not identify {weak} direction(s) of the "
        f"prior (terms {', '.join(ident['weak_terms'])}): predictions that depend on them "
        "carry the vague starting prior's σ, not a learned one. Calibrate some units over "
        "the whole range, or use lower orders."
    )


def selection_note(state: dict[str, Any], final: pd.DataFrame) -> str:
    """One line on fedprior's time-respecting choice: the candidates ranked by the fleet's
    forward-validation score (lower is better) and the units that ship a simple fit."""
    forward = (state.get("selection") or {}).get("forward")
    if not forward:
        return ""
    ranked = ", ".join(f"{r['candidate']} {r['score']:g}" for r in forward["ranked"])
    text = f"chosen by each unit's forward validation (lower is better): {ranked}"
    if "fallback" in final:
        ships = final["fallback"].astype(str)
        counts = ships[ships != "prior"].value_counts()
        if len(counts):
            text += "; no-harm fall-back: " + ", ".join(f"{v} {k}" for k, v in counts.items())
    return text


def jitter_note(jitter: pd.Series, worst: float) -> str:
    """One line when a near-singular Gram needed jitter or an eigenvalue floor (core.bayes)."""
    what = "an eigenvalue floor" if worst >= 1.0 else f"a relative jitter up to {worst:.0e}"
    return (
        f"near-singular Gram matrices (collinear features?) needed {what} in "
        f"{int((jitter > 0).sum())} unit-round(s) (metrics.csv column 'jitter')"
    )


def unjudged_note(rounds_log: list[dict]) -> str:
    """``"<k> <note>"`` when the robust M-step judged nobody in k rounds, else ""."""
    marked = [r for r in rounds_log if r.get("unjudged")]
    if not marked:
        return ""
    few = min(int(r["cohort"]) for r in marked)
    return (
        f'{len(marked)} robust = "full" judged nobody in {len(marked)} of {len(rounds_log)} '
        f"round(s): {few} unit(s) are too few to judge each against the others (more than "
        "the basis's terms + 2 needed); a hostile unit would not have been down-weighted"
    )
