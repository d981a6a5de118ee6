"""The ``fedcal`` command line.

Stable interface (scripts call it)::

    fedcal run [--data FILE] [--features COL,COL,...] [--target COL]
               [--methods fedgmi,fedavg,local] [--seeds N] [--rounds R]
               [--config FILE] [--out DIR] [--train-points N or 12,24,48]
               [--designs 3x2,4x3] [--fleet-seeds 0,1,2]
    fedcal compare [the same options: one definition; compare also shows bytes sent]
    fedcal simulate --out fleet.parquet
    fedcal methods [--config FILE]
    fedcal export RUN_DIR [--method M] [--seed 0] [--format c|json|onnx] --out FILE|DIR
    fedcal report RUN_DIR [--markdown] [--html FILE]
    fedcal plan --prior RUN_DIR --plateaus K --points N --out design.csv [--spec S]
    fedcal plan --prior RUN_DIR --unit unit.csv --next [--spec S] [--count N]
    fedcal calibrate --prior RUN_DIR --data new_units.csv --out DIR [--sensor-column COL]
    fedcal predict RUN_DIR --data readings.csv --out calibrated.csv [--method M]

export and predict take the run's only method (several: --method names one);
every command reads sensor ids from the run's column (--sensor-column: another).

run and compare also take --quiet (no progress bar, no table), --html FILE
(write the HTML report when done) and --aggregation RULE. The progress bar
shows only on a terminal.

Exit codes: 0 done, every method ran and no sensor diverged; 1 the table was
printed but a method failed or a sensor diverged (each named above the exit);
2 refused input — a bad option, configuration, data file, method name or run
directory, reported on one line before anything is trained or written; 3 an
internal error (one line; --debug shows the trace); 130 interrupted (Ctrl-C;
the same command resumes from the last checkpoint).
"""

# The app and its commands, one module per group (each imports its heavy modules when it
# runs). Registration order is the order of ``fedcal --help``.
# isort: off
from fedcal.cli.base import app, console, err_console, main, progress_bar, target_unit
from fedcal.cli import run  # run, compare, simulate, methods
from fedcal.cli import serve  # export, predict
from fedcal.cli import calibrate  # calibrate, certificate
from fedcal.cli import plan, report, flower

# isort: on
from fedcal.cli.options import (
    AGGREGATION_RULES,
    DECISION_RULES,
    EXPORT_FORMATS,
    SIMULATOR_CHOICES,
    SPLIT_BY,
)

__all__ = [
    "AGGREGATION_RULES",
    "DECISION_RULES",
    "EXPORT_FORMATS",
    "SIMULATOR_CHOICES",
    "SPLIT_BY",
    "app",
    "calibrate",
    "console",
    "err_console",
    "flower",
    "main",
    "plan",
    "progress_bar",
    "report",
    "run",
    "serve",
    "target_unit",
]
