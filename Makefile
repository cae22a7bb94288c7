# Two entry points for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo demo-torch plan-demo test lint venv clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

venv: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev,workers]'
	touch $@

# The whole stack on this machine, autoscaling through a burst, on emulated accelerators
# (Llama-2-70B TP4 on A100), beside the simulator replaying the same requests (~5 min).
demo: venv
	$(BIN)/python -m cli.live_demo --out demo-out

# The same with a small Llama in PyTorch on this CPU (its profile measured first).
demo-torch: venv
	$(BIN)/python -m cli.live_demo --engine torch --out demo-out-torch

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
