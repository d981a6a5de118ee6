"""The figures README.md and docs/ quote for the default run and the Python API, in one file:
docs/figures.json (issue 37.6). tests/test_docs_figures.py checks every quote listed in
fedcal_support/docs_figures.py against it, so a page that drifts fails the suite.

    python benchmarks/docs_figures.py                      # make run's command, then the API
    python benchmarks/docs_figures.py --run runs/default   # reuse a finished default run

The default run is `fedcal run --config quickstart --out DIR` (fleet seed 0, one training
seed; deterministic); the API figures are docs/python-api.md's (benchmarks/python_api.py's
fleets, seeds 0, 1, 2). Wall time is not recorded: it is not reproducible.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedcal_support.docs_figures import FIGURES, api_figures, check, header_figures, run_figures


def default_run(out: Path) -> Path:
    """make run's command (`fedcal run --config quickstart`) into ``out``."""
    from fedcal.cli import app

    app(["run", "--config", "quickstart", "--out", str(out), "--quiet"], standalone_mode=False)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, help="a finished default run (else: run it)")
    parser.add_argument("--out", type=Path, default=FIGURES)
    parser.add_argument("--no-api", action="store_true", help="keep the file's API figures")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = args.run or default_run(Path(tmp) / "default")
        figures = {"run": run_figures(run), "c_header": header_figures(run)}
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    figures["api"] = old.get("api", {}) if args.no_api else api_figures()
    args.out.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
    problems, checked = check(figures)
    print(f"wrote {args.out}; {checked} quoted numbers checked, {len(problems)} off:")
    for line in problems:
        print(f"  {line}")


if __name__ == "__main__":
    main()
