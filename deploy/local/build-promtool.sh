#!/usr/bin/env bash
# Build promtool (Prometheus's rule checker and rule unit-test runner) from the Go module proxy
# into a cache directory, once, and print its path. Later calls return at once.
# Prometheus 3.x is published as Go module versions v0.3XX.Y (v0.316.0 is Prometheus 3.16.0);
# a plain `go install` works (no replace directives). The first build downloads the module graph
# and takes minutes; with a warm Go module cache it takes well under a minute.
set -euo pipefail

PROMETHEUS_VERSION=3.16.0
MODULE_VERSION=v0.316.0
cache=${GRAPHKEEPER_CACHE:-$HOME/.cache/graphkeeper}
bin=$cache/bin/prometheus-v$PROMETHEUS_VERSION
mkdir -p "$bin"

if [ ! -x "$bin/promtool" ]; then
  command -v go >/dev/null || { echo "build-promtool: go is not installed" >&2; exit 1; }
  export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod
  # One build at a time (parallel test sessions share the cache).
  exec 9>"$bin/.lock"
  flock 9
  if [ ! -x "$bin/promtool" ]; then
    echo "build-promtool: building promtool $PROMETHEUS_VERSION into $bin (first time takes minutes)" >&2
    v=github.com/prometheus/common/version
    tmp=$(mktemp -d "$bin/.build.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    GOBIN="$tmp" go install -trimpath \
      -ldflags "-s -w -X $v.Version=$PROMETHEUS_VERSION -X $v.Branch=HEAD -X $v.Revision=$MODULE_VERSION" \
      "github.com/prometheus/prometheus/cmd/promtool@$MODULE_VERSION"
    mv "$tmp/promtool" "$bin/promtool"
  fi
fi
# --server: the Prometheus server too, for the local cluster (deploy/local/prometheus.sh). Debian's
# prometheus package is built without Kubernetes service discovery, which the dashboard's target
# labels come from. No web UI assets (the API is all the scripts and tests use).
if [ "${1:-}" = --server ]; then
  [ -x "$bin/prometheus" ] && { echo "$bin/prometheus"; exit 0; }
  export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod
  exec 9>"$bin/.lock"
  flock 9
  if [ ! -x "$bin/prometheus" ]; then
    echo "build-promtool: building prometheus $PROMETHEUS_VERSION into $bin" >&2
    v=github.com/prometheus/common/version
    tmp=$(mktemp -d "$bin/.build.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    GOBIN="$tmp" go install -trimpath \
      -ldflags "-s -w -X $v.Version=$PROMETHEUS_VERSION -X $v.Branch=HEAD -X $v.Revision=$MODULE_VERSION" \
      "github.com/prometheus/prometheus/cmd/prometheus@$MODULE_VERSION"
    mv "$tmp/prometheus" "$bin/prometheus"
  fi
  echo "$bin/prometheus"
  exit 0
fi
echo "$bin/promtool"
