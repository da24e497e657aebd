# graphkeeper: two commands.
#   make run    set up (virtualenv, install) and start a worker serving a small model on this machine
#   make test   set up and run the whole test suite (ruff included); GPU tests skip without a GPU
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= random:tiny
DEVICE ?= $(shell python3 -c "import shutil;print('cuda' if shutil.which('nvidia-smi') else 'cpu')")

.PHONY: setup run test test-cuda cluster-up cluster-down

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $@

run: setup
	$(BIN)/graphkeeper worker --model $(MODEL) --device $(DEVICE) --port 50051 --metrics-port 9400

test: setup
	$(BIN)/pytest

test-cuda: setup
	$(BIN)/pytest -m cuda

cluster-up: setup
	PATH=$(abspath $(BIN)):$$PATH deploy/local/cluster.sh up

cluster-down:
	deploy/local/cluster.sh down
