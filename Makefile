# graphkeeper.
#   make demo       the whole system on a real single-node Kubernetes on this machine (root, Debian)
#   make run        set up (virtualenv, install) and start a worker serving a small model on this machine
#   make test       set up and run the test suite (ruff included); GPU tests skip without a GPU
#   make test-e2e   the end-to-end suite on a real node (helm install, kubelet, containerd, Prometheus)
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= random:tiny
DEVICE ?= $(shell python3 -c "import shutil;print('cuda' if shutil.which('nvidia-smi') else 'cpu')")

.PHONY: setup run test test-cuda test-e2e cluster-up cluster-down node-deps demo demo-down images

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

test-e2e: setup node-deps
	GRAPHKEEPER_E2E=1 $(BIN)/pytest tests/e2e -p no:cacheprovider
