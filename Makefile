# rpcbuf: the two commands a new user needs are `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: install run test lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test,lint]"
	touch $(STAMP)

run: install  ## start a daemon, run the demo, stop the daemon
	$(BIN)/python scripts/demo.py

lint: install
	$(BIN)/ruff check src tests scripts
	$(BIN)/mypy

test: install lint  ## the whole suite: lint, unit and integration tests
	$(BIN)/python -m pytest -q

bench: install  ## prints tables and writes bench.json, bench_alloc.json
	$(BIN)/python scripts/bench.py --json bench.json
	$(BIN)/python scripts/bench_alloc.py --json bench_alloc.json

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
