"""``python -m fedcal.calibration``: rewrite the shipped record
(fedcal/prior/calibrate_record.json, :func:`fedcal.calibration.record_template`)."""

import json

from fedcal.calibration.rebuild import record_template
from fedcal.experiment import _write_text
from fedcal.prior.calibrate_dir import TEMPLATE

_write_text(TEMPLATE, json.dumps(record_template(), indent=1) + "\n")
print(f"wrote {TEMPLATE}")
