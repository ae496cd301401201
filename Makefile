# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint gpu-test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/serve.py --demo

# Two pytest-xdist workers (CI has 2 cores), each test file kept in one worker so its
# module-scoped compiles are made once. (Grouping by file but spreading the docs pages,
# --dist loadgroup, was tried: 19.2 min for a fresh clone's CI, against 18.4 with
# loadfile on the same day's slower machine; one run each.)
PYTEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile

# The edit-test loop: tests/unit, the tests that compile nothing (about 15 s on 2 cores).
# The other folders of tests/ hold what costs more: compile/ (small graphs), models/,
# fleet/ (several processes, the remote tier) and gpu/.
test-fast: $(STAMP)
	$(PY) -m pytest tests/unit

lint: $(STAMP)
	$(VENV)/bin/ruff check precompile cache runtime tests examples benchmarks
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build *.egg-info
