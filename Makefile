# Two entry points: `make demo` (the main job) and `make test`. Each sets itself up on a fresh machine.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test bench setup clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/lengthgen compare --out runs/demo --resume

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 tests

bench: $(STAMP)
	$(BIN)/python benchmarks/attention_cpu.py

clean:
	rm -rf $(VENV) runs .pytest_cache
