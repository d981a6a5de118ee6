"""Compile an exported fedcal C header with the system C compiler and evaluate it.

The driver reads lines ``sensor x0 x1 …`` (sensor index, raw inputs) on stdin and
prints, per line, ``fedcal_calibrate_d``, ``fedcal_calibrate`` (float),
``fedcal_calibrate_std`` (NaN without σ), ``fedcal_in_range`` (-1 without a
range guard), ``fedcal_beyond_support`` (-1 without an extrapolation guard) and
``fedcal_calibrate_std_d`` (the σ in double; NaN without σ).
No compiler is a RuntimeError, never a skip.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np

DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
#include "HEADER"
int main(void) {
    int s;
    float x[FEDCAL_NUM_INPUTS];
    for (;;) {
        if (scanf("%d", &s) != 1) break;
        for (int j = 0; j < FEDCAL_NUM_INPUTS; ++j)
            if (scanf("%f", &x[j]) != 1) return 2;
        double std = NAN, std_d = NAN;
        int inside = -1, beyond = -1;
#if defined(FEDCAL_HAS_STD) && FEDCAL_HAS_STD
        std = fedcal_calibrate_std(s, x);
        std_d = fedcal_calibrate_std_d(s, x);
#endif
#ifdef RANGE
        inside = fedcal_in_range(s, x);
#endif
#if defined(FEDCAL_HAS_GUARD) && FEDCAL_HAS_GUARD
        beyond = fedcal_beyond_support(s, x);
#endif
        printf("%.17g %.9g %.9g %d %d %.17g\n", fedcal_calibrate_d(s, x),
               (double)fedcal_calibrate(s, x), std, inside, beyond, std_d);
    }
    return 0;
}
"""


def compiler() -> str:
    """The system C compiler (``cc`` or ``gcc``); none is an error (the test must not pass)."""
    for name in ("gcc", "cc"):
        path = shutil.which(name)
        if path:
            return path
    raise RuntimeError("no C compiler (gcc/cc) on PATH: the C export cannot be checked")


def build(header: Path, workdir: Path, defines: dict[str, str] | None = None, range_guard=True):
    """Compile the driver against ``header`` (-std=c99 -Wall -Werror); returns the executable."""
    workdir.mkdir(parents=True, exist_ok=True)
    src = workdir / "driver.c"
    src.write_text(
        ("#define RANGE 1\n" if range_guard else "") + DRIVER.replace("HEADER", header.name)
    )
    exe = workdir / "driver"
    flags = [f"-D{k}={v}" for k, v in (defines or {}).items()]
    cmd = [compiler(), "-std=c99", "-O2", "-Wall", "-Wextra", "-Werror", *flags]
    subprocess.run(
        [*cmd, f"-I{header.parent}", str(src), "-o", str(exe), "-lm"],
        check=True,
        capture_output=True,
        text=True,
    )
    return exe


def evaluate(exe: Path, sensors: np.ndarray, x: np.ndarray) -> np.ndarray:
    """(rows, 6): calibrate (double), calibrate (float), std, in_range, beyond_support,
    std (double)."""
    lines = "\n".join(
        f"{int(s)} " + " ".join(repr(float(v)) for v in row)
        for s, row in zip(sensors, x, strict=True)
    )
    out = subprocess.run([str(exe)], input=lines + "\n", check=True, capture_output=True, text=True)
    return np.array([[float(v) for v in ln.split()] for ln in out.stdout.splitlines()])
