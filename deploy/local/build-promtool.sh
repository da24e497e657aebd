#!/usr/bin/env bash
# Build promtool (Prometheus's rule checker and rule unit-test runner) from the Go module proxy
# into a cache directory, once, and print its path. Later calls return at once.
#   build-promtool.sh           promtool (what `make test` needs)
#   build-promtool.sh --server  also the Prometheus server (the local cluster's, deploy/local/prometheus.sh,
#                               which the end-to-end suite runs), and print its path
# Prometheus 3.x is published as Go module versions v0.3XX.Y (v0.316.0 is Prometheus 3.16.0);
# a plain `go install` works (no replace directives). Both are built with Kubernetes service
# discovery only (Prometheus's own build tags remove_all_sd,enable_kubernetes_sd; file and http SD
# stay): the cloud providers' SDKs (AWS, Azure, GCE, ...) are most of the module graph and of the
# compile time, and nothing here uses them. The first build downloads the modules it needs and
# takes minutes; with a warm Go module cache it takes well under a minute.
# With GRAPHKEEPER_NO_BUILD=1 (how .ci/run and `make test-e2e` run the tests) it builds nothing: it
# prints the path when the binary is there and fails at once when it is not.
set -euo pipefail

PROMETHEUS_VERSION=3.16.0
MODULE_VERSION=v0.316.0
SD_TAGS=remove_all_sd,enable_kubernetes_sd
cache=${GRAPHKEEPER_CACHE:-$HOME/.cache/graphkeeper}
bin=$cache/bin/prometheus-v$PROMETHEUS_VERSION
server=0
[ "${1:-}" = --server ] && server=1

build() { # build NAME: cmd/NAME of Prometheus into $bin, one build at a time
  local name=$1
  [ -x "$bin/$name" ] && return
  if [ "${GRAPHKEEPER_NO_BUILD:-0}" = 1 ]; then
    echo "build-promtool: $bin/$name is not built and GRAPHKEEPER_NO_BUILD=1 (tests build nothing): run" \
      "deploy/local/build-promtool.sh$([ "$server" = 1 ] && echo " --server") first (.ci/run and make test-e2e do)" >&2
    exit 1
  fi
  command -v go >/dev/null || { echo "build-promtool: go is not installed" >&2; exit 1; }
  mkdir -p "$bin"
  # One build at a time (parallel sessions share the cache).
  exec 9>"$bin/.lock"
  flock 9
  if [ ! -x "$bin/$name" ]; then
    echo "build-promtool: building $name $PROMETHEUS_VERSION into $bin (first time takes minutes)" >&2
    local v=github.com/prometheus/common/version tmp
    tmp=$(mktemp -d "$bin/.build.XXXXXX")
    CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod GOBIN="$tmp" go install -trimpath -tags "$SD_TAGS" \
      -ldflags "-s -w -X $v.Version=$PROMETHEUS_VERSION -X $v.Branch=HEAD -X $v.Revision=$MODULE_VERSION" \
      "github.com/prometheus/prometheus/cmd/$name@$MODULE_VERSION" || { rm -rf "$tmp"; exit 1; }
    mv "$tmp/$name" "$bin/$name"
    rm -rf "$tmp"
  fi
  exec 9>&-
}

build promtool
# The server: Debian's prometheus package is built without Kubernetes service discovery, which the
# dashboard's target labels come from. No web UI assets (the API is all the scripts and tests use).
if [ "$server" = 1 ]; then
  build prometheus
  echo "$bin/prometheus"
  exit 0
fi
echo "$bin/promtool"
