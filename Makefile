# Two entry points: `make demo` (the main job) and `make test`. Each sets itself up on a fresh machine and
# works when run again. The demo installs the package alone; the tests add the `dev` extras (pytest, triton,
# transformers, wandb).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
CORE    := $(VENV)/.installed-core
DEV     := $(VENV)/.installed-dev

.PHONY: demo test bench setup clean

$(CORE): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e .
	touch $(CORE)

$(DEV): $(CORE)
	$(BIN)/pip install -e ".[dev]"
	touch $(DEV)

setup: $(DEV)

# A fresh runs/demo each time (an earlier demo's folder is replaced).
demo: $(CORE)
	rm -rf runs/demo
	$(BIN)/lengthgen compare --out runs/demo
	@echo "lengthgen is in $(BIN): 'source $(BIN)/activate' puts it on the PATH (or run $(BIN)/lengthgen)"

test: $(DEV)
	$(BIN)/python -m pytest -n 2 tests

bench: $(CORE)
	$(BIN)/python benchmarks/attention_cpu.py

clean:
	rm -rf $(VENV) runs .pytest_cache
