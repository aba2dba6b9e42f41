# The two README commands. Each does its own set-up (scripts/setup.sh) first.
PYTHON ?= python3
NPROC ?= 4

.PHONY: setup train test lint

setup:
	bash scripts/setup.sh

train: setup
	cp-train --nproc $(NPROC) --cp-size $(NPROC) --cp-comm-type p2p --seq-len 512 --batch-size 4 --steps 120 \
		--metrics-out runs/train_metrics.json

test: setup
	$(PYTHON) -m pytest -q

lint: setup
	ruff check cp_handler tests
