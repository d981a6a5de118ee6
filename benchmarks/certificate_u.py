"""Figure of docs/certificate.md: how often a held-out reading's error is within the
certificate's U (k = 2), per new unit, on mixed fleets (fleet seeds 0, 1, 2).

Prior: 20 fully calibrated units + 2 units of the new units' 3x2 design; 10 new units of
that design (6 chamber points each), 60 random off-grid held-out readings per unit.
U = 2σ of ``CalibratedUnits.predict`` — what ``fedcal certificate`` states. Run:
python benchmarks/certificate_u.py
"""

import numpy as np

from fedcal import FleetPrior
from fedcal.data.simulator import FleetSpec, simulate_fleet

spec = FleetSpec(num_reference=20, num_new=12, train_design="3x2", test_design="random")
for seed in (0, 1, 2):
    frame = simulate_fleet(spec, seed=seed).frame
    prior = FleetPrior().fit(frame[frame.sensor_id <= "S021"])  # 20 calibrated + 2 of 3x2
    new = frame[frame.sensor_id > "S021"]  # 10 new units
    units = prior.calibrate(new[new.split == "train"])
    test = new[new.split == "test"].reset_index(drop=True)
    mean, std, inside = units.predict(test, return_std=True, return_range=True)
    err = np.abs(mean - test.pressure_hpa.to_numpy())
    per = (
        test.assign(within=err <= 2.0 * std, u=2.0 * std, e=err)
        .groupby("sensor_id")
        .agg(within=("within", "mean"), u=("u", "max"), e=("e", "max"))
    )
    print(
        f"fleet seed {seed}: {len(per)} units, {len(test)} readings ({inside.mean():.0%} in "
        f"range); |error| <= U: mean {per.within.mean():.3f}, worst unit {per.within.min():.3f}; "
        f"largest U per unit, mean {per.u.mean():.3f} hPa; largest |error| per unit, mean "
        f"{per.e.mean():.3f} hPa"
    )
