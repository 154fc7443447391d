# Fresh machine (only python3 >= 3.10 and make):
#   make run   install into .venv, fetch the default model, answer one chat prompt
#   make test  install into .venv (with test extras), fetch the default model, run the test suite
# Override the interpreter used to create the venv with PYTHON=, the venv itself with VENV=.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CHECKPOINT ?= checkpoints/SmolLM2-135M-Instruct
PROMPT ?= What is the capital of France?

PEERS_DIR ?= ../peers

.PHONY: venv install install-test model run test test-fast clean-venv peers

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

venv: $(PY)

install: $(PY)
	$(PY) -m pip install --quiet -e .

install-test: $(PY)
	$(PY) -m pip install --quiet -e ".[test]"

model: install         # the fetch converts the checkpoint with the installed project (torch, safetensors)
	$(PY) scripts/fetch_default_model.py

run: install model
	$(PY) engine.py --checkpoint $(CHECKPOINT) --chat --prompt "$(PROMPT)" --max-new-tokens 64

# Two pytest workers (one torch thread each, see tests/conftest.py); TEST_WORKERS=0 runs in one process.
# The 25 slowest tests are printed; every test file's total time is kept in runs/test-durations.txt.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --durations=25 --durations-file=runs/test-durations.txt

test: install-test model
	$(PYTEST) tests

test-fast: install-test model
	$(PYTEST) -m "not slow" tests

# The serving peers of scripts/loadtest.py (vLLM CPU, OpenVINO GenAI, llama-server), each in PEERS_DIR (outside the
# repository): needs network to PyPI, cmake and a C++ compiler; about 20 minutes on 2 cores (docs/serving.md, Peers).
peers: model
	bash scripts/setup_peers.sh $(PEERS_DIR)

clean-venv:
	rm -rf $(VENV)
