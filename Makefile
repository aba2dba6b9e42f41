# The two README commands. Each installs what it needs first, and nothing when it is there already
# (scripts/setup.sh main: torch and this package; scripts/setup.sh test: also the test extra).
# PYTHON: the interpreter to install into and run (default python3: an active venv's);
# VENV=DIR: a venv at DIR instead, made by scripts/setup.sh when missing.
PYTHON ?= python3
NPROC ?= 4
VENV ?=
PY = $(if $(VENV),$(VENV)/bin/python,$(PYTHON))
SETUP = PYTHON="$(PYTHON)" VENV="$(VENV)" bash scripts/setup.sh
TRAIN_CKPT ?= runs/train_ckpt

.PHONY: setup train test lint

setup:
	$(SETUP) test

# Saves its final checkpoint to $(TRAIN_CKPT) (make train's own folder, replaced on every run) and prints the
# cp-generate command that continues a prompt from it.
train:
	$(SETUP) main
	rm -rf $(TRAIN_CKPT)
	$(PY) -m cp_handler.cli.train --nproc $(NPROC) --cp-size $(NPROC) --cp-comm-type p2p --seq-len 512 \
		--batch-size 4 --steps 120 --metrics-out runs/train_metrics.json --save $(TRAIN_CKPT)

# Test files run on TEST_WORKERS workers (pytest-xdist, one file per worker at a time): the suite waits on rank
# start-up and rendezvous as much as it computes (docs/testing.md). Bytecode caching on for the suite (an environment
# with PYTHONDONTWRITEBYTECODE set made each of its ~300 fresh interpreters compile cp_handler and the tests again;
# Python's default; the caches go to __pycache__/, which git ignores).
TEST_WORKERS ?= 2

test:
	$(SETUP) test
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

lint:
	$(SETUP) test
	$(PY) -m ruff check cp_handler tests
