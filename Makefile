# fedcal — the two set-up commands:
#   make run    install (first time); compare the per-sensor polynomial, fedcal's best method and
#               FedGMI on the embedded default fleet; write the HTML report and print its path
#   make test   install (first time) and run the test suite
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test bench lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e ".[dev,flower]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/fedcal run --config quickstart --out runs/default --html runs/default/report.html

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_speed.py
	$(BIN)/python benchmarks/fleet_scale.py

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks studies fedcal_support
	$(BIN)/ruff format --check src tests benchmarks studies fedcal_support
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) runs .pytest_cache
