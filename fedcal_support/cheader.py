"""Compile an exported fedcal C header with the system C compiler and evaluate it.

The driver reads lines ``sensor x0 x1 …`` (sensor index, raw inputs) on stdin and
prints, per line, ``fedcal_calibrate_d``, ``fedcal_calibrate`` (float),
``fedcal_calibrate_std`` (NaN without σ), ``fedcal_in_range`` (-1 without a
range guard), ``fedcal_beyond_support`` (-1 without an extrapolation guard) and
``fedcal_calibrate_std_d`` (the σ in double; NaN without σ), then the same of the
readings in double (the ``_f64`` functions): ``fedcal_calibrate_f64``,
``fedcal_calibrate_std_f64``, ``fedcal_in_range_f64``, ``fedcal_beyond_support_f64``
(linear-in-basis headers; the MLP header's columns repeat the float ones). The float
functions get each reading rounded to float.
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
    double xd[FEDCAL_NUM_INPUTS];
    for (;;) {
        if (scanf("%d", &s) != 1) break;
        for (int j = 0; j < FEDCAL_NUM_INPUTS; ++j) {
            if (scanf("%lf", &xd[j]) != 1) return 2;
            x[j] = (float)xd[j];
        }
        double std = NAN, std_d = NAN, std_f64 = NAN, y_f64;
        int inside = -1, beyond = -1, inside_f64 = -1, beyond_f64 = -1;
#if defined(FEDCAL_HAS_STD) && FEDCAL_HAS_STD
        std = fedcal_calibrate_std(s, x);
        std_d = fedcal_calibrate_std_d(s, x);
        std_f64 = fedcal_calibrate_std_f64(s, xd);
#endif
#ifdef RANGE
        inside = fedcal_in_range(s, x);
        inside_f64 = fedcal_in_range_f64(s, xd);
#endif
#if defined(FEDCAL_HAS_GUARD) && FEDCAL_HAS_GUARD
        beyond = fedcal_beyond_support(s, x);
        beyond_f64 = fedcal_beyond_support_f64(s, xd);
#endif
#ifdef FEDCAL_NUM_TERMS
        y_f64 = fedcal_calibrate_f64(s, xd);
#else
        y_f64 = (double)fedcal_calibrate(s, x);
#endif
        printf("%.17g %.9g %.9g %d %d %.17g %.17g %.17g %d %d\n", fedcal_calibrate_d(s, x),
               (double)fedcal_calibrate(s, x), std, inside, beyond, std_d, y_f64, std_f64,
               inside_f64, beyond_f64);
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
    """(rows, 10): of the readings rounded to float: calibrate (double), calibrate (float),
    std, in_range, beyond_support, std (double); of the readings in double (17 digits):
    calibrate, std, in_range, beyond_support (the ``_f64`` functions)."""
    lines = "\n".join(
        f"{int(s)} " + " ".join(f"{float(v):.17g}" for v in row)
        for s, row in zip(sensors, x, strict=True)
    )
    out = subprocess.run([str(exe)], input=lines + "\n", check=True, capture_output=True, text=True)
    return np.array([[float(v) for v in ln.split()] for ln in out.stdout.splitlines()])


FIND = r"""
#include <stdio.h>
#include "HEADER"
int main(int argc, char **argv) {
    for (int i = 1; i < argc; ++i) {
        int k = fedcal_find_unit(argv[i]);
#ifdef FEDCAL_NUM_TERMS
        const FEDCAL_COEF_T *c = fedcal_unit_coef(argv[i]);
        int same = (k < 0 && c == NULL) || (k >= 0 && c == fedcal_coef[k]);
#else
        int same = 1;
#endif
        printf("%d %d %s\n", k, same, k >= 0 ? fedcal_sensor_ids[k] : "-");
    }
    return fedcal_find_unit(NULL) == -1 ? 0 : 3;
}
"""


def find_units(header: Path, workdir: Path, ids: list[str]) -> list[tuple[int, bool, str]]:
    """Per id: (``fedcal_find_unit(id)``, whether ``fedcal_unit_coef(id)`` is that unit's
    coefficient row or NULL for -1 (linear headers), the id at that index)."""
    workdir.mkdir(parents=True, exist_ok=True)
    src = workdir / "find.c"
    src.write_text(FIND.replace("HEADER", header.name))
    exe = workdir / "find"
    cmd = [compiler(), "-std=c99", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{header.parent}"]
    subprocess.run([*cmd, str(src), "-o", str(exe), "-lm"], check=True, capture_output=True)
    out = subprocess.run([str(exe), *ids], check=True, capture_output=True, text=True)
    rows = [line.split(" ", 2) for line in out.stdout.splitlines()]
    return [(int(k), same == "1", name) for k, same, name in rows]
