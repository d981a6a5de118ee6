"""The real-network study's summary (fedcal_support.realnets; review B of issue 34): the
"all sensors" mean of a method is over every sensor of the simple fits; a sensor missing
from the run is reported, not dropped."""

from __future__ import annotations

import pandas as pd

from fedcal.data.fleet import CLIENT_COLUMN
from fedcal_support import realnets


def _run(tmp_path, sensors):
    folder = tmp_path / "runs" / "fedprior_s0"
    folder.mkdir(parents=True)
    rows = [dict(method="fedprior", client=s, test_rmse=1.0, status="ok") for s in sensors]
    pd.DataFrame(rows).to_csv(folder / "per_sensor.csv", index=False)
    return tmp_path


def test_a_sensor_missing_from_the_run_fails_the_method(tmp_path) -> None:
    base = pd.DataFrame(
        {CLIENT_COLUMN: ["A", "B", "C"], "own_linear": [1.0, 1.0, 9.0], "pooled_linear": 2.0}
    )
    whole = realnets.summarize("net", base, _run(tmp_path / "a", ["A", "B", "C"]), ["fedprior"])
    assert whole[-1]["rmse_mean"] == 1.0 and whole[-1]["statuses"] == "ok 3"
    part = realnets.summarize("net", base, _run(tmp_path / "b", ["A", "B"]), ["fedprior"])
    assert "rmse_mean" not in part[-1]
    assert part[-1]["statuses"].startswith("failed: 1 sensor(s)") and "(C)" in part[-1]["statuses"]
