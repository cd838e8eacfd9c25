# Two set-up commands: `make demo` and `make test`. Both create .venv on first use.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install -c constraints.txt

.PHONY: demo test bench lint graph venv clean

$(BIN)/.installed: pyproject.toml constraints.txt
	@command -v $(PY) >/dev/null || { echo "need $(PY) (Python 3.11) on PATH"; exit 2; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) -q --upgrade pip
	$(PIP) -q -e '.[dev]'
	@touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/microbatch demo

# Two workers (one a core on CI's 2-core machine; at most 4 elsewhere), a test file to a worker: the files'
# shared runs stay shared, and the multi-process tests leave one core idle less often (16 min -> 11 min here).
# The tests marked serial compare timings taken at two moments, or run ranks on both cores against a time bound:
# they run alone, after.
test: venv
	$(BIN)/python -m pytest -q -p no:cacheprovider -n auto --maxprocesses 4 --dist loadfile -m "not serial"
	$(BIN)/python -m pytest -q -p no:cacheprovider -m serial

bench: venv
	$(BIN)/python bench/run_all.py

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy

graph: venv
	$(BIN)/python tests/test_architecture.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
