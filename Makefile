# Two entry points: `make demo` (the main job) and `make test`. Each sets itself up on a fresh machine and
# works when run again. The demo installs the package alone; the tests add the `dev` extras (pytest, triton,
# transformers, wandb); both at the versions in constraints.txt.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
CORE    := $(VENV)/.installed-core
DEV     := $(VENV)/.installed-dev

.PHONY: demo test bench gpu-check setup clean

$(CORE): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -c constraints.txt -e .
	touch $(CORE)

$(DEV): $(CORE)
	$(BIN)/pip install -c constraints.txt -e ".[dev]"
	touch $(DEV)

setup: $(DEV)

# A fresh runs/demo each time (--overwrite replaces an earlier demo's files); 4 seeds, so that the report can name
# a winner where the seeds separate (3 never can: p >= 0.1), two runs at a time.
demo: $(CORE)
	$(BIN)/lengthgen compare --seeds 4 --workers 2 --out runs/demo --overwrite
	@echo "lengthgen is in $(BIN): 'source $(BIN)/activate' puts it on the PATH (or run $(BIN)/lengthgen)"

test: $(DEV)
	$(BIN)/python -m pytest -n 2 tests

bench: $(CORE)
	$(BIN)/python benchmarks/attention_cpu.py

# On a GPU machine: nothing installed or downloaded; the .venv's python when there is one, else $(PY) (the system
# python3 with its torch). Results: benchmarks/results/<device>-<date>-<time>.json and .md (benchmarks/README.md).
GPU_PY      := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))
COMMIT      ?= $(shell git rev-parse HEAD 2>/dev/null)
SEED_KERNEL ?=
gpu-check:
	PYTHONPATH=. $(GPU_PY) benchmarks/gpu_check.py $(if $(COMMIT),--commit $(COMMIT)) \
		$(if $(SEED_KERNEL),--seed-kernel $(SEED_KERNEL)) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
