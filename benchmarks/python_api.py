"""Figures of docs/python-api.md: the Python API on mixed fleets (fleet seeds 0, 1, 2).

20 reference units (full campaign) + 20 new units (3x2 design, 6 points), 60 random
off-grid test readings per new unit. Run: python benchmarks/python_api.py
"""

import time

import numpy as np

from fedcal import FleetPrior
from fedcal.data.simulator import FleetSpec, simulate_fleet

spec = FleetSpec(num_reference=20, num_new=20, train_design="3x2", test_design="random")
for seed in (0, 1, 2):
    t0 = time.process_time()
    frame = simulate_fleet(spec, seed=seed).frame
    reference, new = frame[frame.role == "reference"], frame[frame.role == "new"]
    prior = FleetPrior().fit(reference)
    units = prior.calibrate(new[new.split == "train"])
    test = new[new.split == "test"]
    mean, std = units.predict(test, return_std=True)
    err = mean - test.pressure_hpa.to_numpy()
    per = (
        test.assign(e2=err**2, inside=np.abs(err) <= 1.959964 * std)
        .groupby("sensor_id")
        .agg(rmse=("e2", lambda v: np.sqrt(v.mean())), cov=("inside", "mean"))
    )
    print(
        f"fleet seed {seed}: new units RMSE mean {per.rmse.mean():.4f} "
        f"worst {per.rmse.max():.4f} hPa; "
        f"95% coverage mean {per['cov'].mean():.3f} worst {per['cov'].min():.3f}; "
        f"cpu {time.process_time() - t0:.1f} s"
    )
