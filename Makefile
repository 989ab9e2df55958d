# Two commands set up a fresh machine: `make up` runs the stack, `make test` runs the tests.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install up test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and alone: the pinned CPU build, never a CUDA build pulled in by a range.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Flags for `strata up`: make up ARGS="--port 9000 --control-port 9081 --engines 2"
ARGS ?=
up: install
	$(VENV)/bin/strata up $(ARGS)

test: install
	$(PY) -m pytest -q -rs --durations=30  # the slowest tests, in the CI log: the suite must fit its hour

test-fast: install
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
