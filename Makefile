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
# module-scoped compiles are made once.
PYTEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile

# The edit-test loop: the test files that compile nothing (about 30 s on 2 cores).
FAST_TESTS := tests/test_dispatch.py tests/test_expressions.py tests/test_layering.py \
	tests/test_settings.py tests/test_signing.py tests/test_triton_launch.py \
	tests/test_variant_plan.py

test-fast: $(STAMP)
	$(PY) -m pytest $(FAST_TESTS)

lint: $(STAMP)
	$(VENV)/bin/ruff check precompile cache runtime tests examples benchmarks
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build *.egg-info
