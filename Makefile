# Two entry points for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint venv clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

venv: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev,workers]'
	touch $@

demo: venv
	$(BIN)/python -m controller.demo

test: venv
	bash .ci/check

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy queueing sim workers/scheduler.py workers/kv_cache.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
