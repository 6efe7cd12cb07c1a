# make test: fresh virtualenv, CPU torch, the suite through Triton's interpreter.
# make bench: side-by-side benchmark of the seed's blocks; make bench-models: of whole HuggingFace
# models; make bench-budget: memory budgets of those models beside torch.compile's; make
# bench-loss-head: the loss head alone beside torch.compile, its auto-chunker, Liger-Kernel, Cut
# Cross-Entropy and F.linear_cross_entropy (torch >= 2.13); make bench-zoo: the model zoo (30+
# families) in eager, torch.compile and memfuse, families in parallel; make bench-memory: the
# longest sequence and largest batch that train one step, per mode; make bench-trainer: HuggingFace
# Trainer fine-tuning a 1B-class Llama with memfuse beside torch.compile.
# Without a GPU they are small smoke runs through the interpreter, and say so.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0

# The benchmarks' Python: PY if given (make bench PY=python3); else $(PYTHON) when it already
# imports torch with CUDA (a GPU machine with torch preinstalled: nothing is installed); else the
# venv, built as for make test.
ifeq ($(origin PY),command line)
BENCH_PY := $(PY)
else ifneq ($(filter bench%,$(MAKECMDGOALS)),)
BENCH_PY := $(shell $(PYTHON) -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null && echo $(PYTHON))
endif
BENCH_PY := $(or $(BENCH_PY),$(VENV)/bin/python)
BENCH_SETUP = $(if $(filter $(VENV)/bin/python,$(BENCH_PY)),$(VENV)/.installed)

.PHONY: test test-all bench bench-models bench-zoo bench-memory bench-trainer bench-budget bench-loss-head install clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q "$(TORCH_PIN)"
	$(VENV)/bin/python -m pip install -q -e ".[test,bench,models]"
	touch $@

install: $(VENV)/.installed

# One pytest worker per core (pytest-xdist); a module whose tests share an expensive fixture keeps
# them on one worker (xdist_group). make test leaves out the slow tier (tests/conftest.py,
# SLOW_TESTS): 3.5 minutes in a fresh clone on a 2-core development machine (venv included, 2026-11-27;
# CI's machines have taken several times longer). make test-all runs every test: about 4 minutes more there.
test: $(VENV)/.installed
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n auto --dist loadgroup -m "not slow" tests

test-all: $(VENV)/.installed
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n auto --dist loadgroup tests

# ARGS: e.g. --workloads rms --quick (bench), --models gpt2 --modes eager,memfuse_whole (bench-models)
bench: $(BENCH_SETUP)
	$(BENCH_PY) -m benchmarks.run $(ARGS)

bench-models: $(BENCH_SETUP)
	$(BENCH_PY) -m benchmarks.models $(ARGS)

# ARGS: e.g. --families t5,swin --jobs 8 (a family whose JSON is in --out is skipped: --force reruns it)
bench-zoo: $(BENCH_SETUP)
	$(BENCH_PY) -m benchmarks.zoo $(ARGS)

# ARGS: e.g. --model llama8b --search batch --seq 4096 --modes eager,memfuse,memfuse@12GB --budget-s 3000
# (a model x search x mode whose JSON is complete in --out is skipped: --force searches again)
bench-memory: $(BENCH_SETUP)
	$(BENCH_PY) -m benchmarks.memory $(ARGS)

# ARGS: e.g. --modes torch_compile,memfuse,memfuse_layers --steps 50 (each mode in a fresh process)
bench-trainer: $(BENCH_SETUP)
	$(BENCH_PY) -m benchmarks.trainer $(ARGS)

# ARGS: e.g. --models gpt2 --budgets 1.0,0.5 --modes memfuse_backend
bench-budget: $(BENCH_SETUP)
	$(BENCH_PY) -m benchmarks.budget $(ARGS)

# ARGS: e.g. --autocast, --forms function --peers eager,liger,cce,torch_lce,memfuse, --ignore-fraction 0.1
bench-loss-head: $(BENCH_SETUP)
	$(BENCH_PY) -m benchmarks.loss_head $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
