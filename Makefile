# Fresh machine:  make run  (install + fetch the default model + demo chat)
#                 make test (install + fetch the default model + test suite)
PYTHON ?= python3
CHECKPOINT ?= checkpoints/SmolLM2-135M-Instruct
PROMPT ?= What is the capital of France?

.PHONY: install install-test model run test

install:
	$(PYTHON) -m pip install --quiet -e .

install-test:
	$(PYTHON) -m pip install --quiet -e ".[test]"

model:
	$(PYTHON) scripts/fetch_default_model.py
	test -f $(CHECKPOINT)/heavy_channels.json || $(PYTHON) scripts/calibrate_channels.py --checkpoint $(CHECKPOINT)

run: install model
	$(PYTHON) engine.py --checkpoint $(CHECKPOINT) --chat --prompt "$(PROMPT)" --max-new-tokens 64

test: install-test model
	$(PYTHON) -m pytest -q tests
