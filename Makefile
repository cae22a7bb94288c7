# Two entry points for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo plan-demo test lint venv clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

venv: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev,workers]'
	touch $@

# The whole stack on this machine, autoscaling through a burst (about 4-5 minutes).
demo: venv
	$(BIN)/python -m cli.live_demo --out demo-out

# Capacity planning only: solve for a real trace, check the plan in the simulator.
plan-demo: venv
	$(BIN)/python -m cli.demo

test: venv
	bash .ci/check

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy queueing sim workers/scheduler.py workers/kv_cache.py
	$(BIN)/mypy --strict dashboards

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
