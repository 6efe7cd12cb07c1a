# make test: fresh virtualenv, CPU torch, the suite through Triton's interpreter.
# make bench: side-by-side benchmark (a small interpreter smoke run without a GPU).
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0

.PHONY: test bench install clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $@

install: $(VENV)/.installed

test: $(VENV)/.installed
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests

# On a GPU machine with torch and triton preinstalled: make bench PY=python3
bench:
	@if [ -x "$(PY)" ]; then $(PY) -m benchmarks.run $(ARGS); else python3 -m benchmarks.run $(ARGS); fi

clean:
	rm -rf $(VENV) build *.egg-info
