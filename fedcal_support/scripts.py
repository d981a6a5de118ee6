"""The one command-line shape of benchmarks/ and studies/: seeds are a list, ``0,1,2``."""

from __future__ import annotations

import argparse


def seed_list(text: str) -> list[int]:
    """``--seeds`` / ``--fleet-seeds``: distinct non-negative integers, comma-separated.

    An argparse ``type``: anything else is a one-line error naming the value.
    """
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seeds like 0,1,2, got {text!r}") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(
            f"expected distinct non-negative seeds like 0,1,2, got {text!r}"
        )
    return seeds
