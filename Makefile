# fedcal — the two set-up commands:
#   make run    install (first time); on a simulated mixed fleet (20 fully calibrated reference
#               units + 20 new units with 6 chamber points each) compare each unit's own
#               polynomial, fedcal's fleet prior (with its interval coverage) and FedGMI (the
#               seed's method), new and reference units apart; write the HTML report
#   make test   install (first time) and run the test suite
# Both install everything (".[all]": core + neural (torch), flower, onnx, studies, dev); a
# core-only install, without torch (a calibration station: calibrate, plan, predict, export,
# certificate, report), is `pip install .` (docs/getting-started.md#install).
# The seed's protocol instead: .venv/bin/fedcal run --config seed
# torch's CPU-only build (a smaller download, no CUDA libraries), on a machine with internet:
#   make run TORCH_INDEX=https://download.pytorch.org/whl/cpu
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_INDEX ?=

.PHONY: run test bench lint clean

$(STAMP): pyproject.toml
	@echo "fedcal: installing into $(VENV) (first time: a few minutes; torch is the largest download)"
	$(PYTHON) -m venv $(VENV)
	$(if $(TORCH_INDEX),$(BIN)/pip install --progress-bar on --index-url $(TORCH_INDEX) torch)
	$(BIN)/pip install --progress-bar on -e ".[all]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/fedcal run --config quickstart --out runs/default --html runs/default/report.html

# One worker per core (pytest-xdist); a file's tests stay in one worker (module fixtures
# such as the Flower deployment are built once).
test: $(STAMP)
	$(BIN)/python -m pytest -n auto --dist loadfile

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_speed.py
	$(BIN)/python benchmarks/fleet_scale.py

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks studies fedcal_support
	$(BIN)/ruff format --check src tests benchmarks studies fedcal_support
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) runs .pytest_cache
