# Two commands do everything on a fresh machine (Python >= 3.10 on PATH as python3):
#   make check   - step-1 consistency check on the built-in tiny Qwen-Image model (CPU, offline)
#   make test    - the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: check test venv clean

venv: $(VENV)/.installed

# torch is installed first and pinned: on this machine 2.13.0 is a local CPU wheel, while an
# unpinned resolve would download a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,ray]"
	touch $@

check: venv
	$(PY) -m rollout_consistency check

# Lint and format checks first: a red ruff fails the run before the (longer) tests start.
test: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
