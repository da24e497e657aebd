#!/usr/bin/env bash
# Build the local control plane's binaries (kube-apiserver, kube-controller-manager, kubectl, helm)
# from the Go module proxy into a cache directory, once. Later calls return at once.
#   build-bins.sh          the control plane (what `make test` needs)
#   build-bins.sh --node   also a node's binaries, kubelet and kube-scheduler (same module cache:
#                          a minute or two more), and kube-score for the end-to-end suite
# With GRAPHKEEPER_NO_BUILD=1 (how .ci/run and `make test-e2e` run the tests) it builds nothing: it
# prints the directory when everything asked for is there and fails at once, naming what is not.
# Go 1.26.x is required: Go 1.27's default JSON mode breaks the OpenAPI documents of Kubernetes <= 1.36.
set -euo pipefail

K8S_VERSION=v1.36.3
HELM_VERSION=v3.22.0
KUBE_SCORE_VERSION=v1.20.0
node=0
[ "${1:-}" = --node ] && node=1
here=$(cd "$(dirname "$0")" && pwd)
cache=${GRAPHKEEPER_CACHE:-$HOME/.cache/graphkeeper}
bin=$cache/bin/k8s-$K8S_VERSION
mkdir -p "$bin"

# Called before every build: refuses under GRAPHKEEPER_NO_BUILD=1, checks Go (not needed when all is cached).
building() { # building WHAT
  if [ "${GRAPHKEEPER_NO_BUILD:-0}" = 1 ]; then
    echo "build-bins: $1 is not in $bin and GRAPHKEEPER_NO_BUILD=1 (tests build nothing): run" \
      "deploy/local/build-bins.sh$([ "$node" = 1 ] && echo " --node") first (.ci/run and make test-e2e do)" >&2
    exit 1
  fi
  command -v go >/dev/null || { echo "build-bins: go is not installed (need Go 1.26.x)" >&2; exit 1; }
  case "$(go env GOVERSION)" in
    go1.26.*) ;;
    *) echo "build-bins: need Go 1.26.x, found $(go env GOVERSION)" >&2; exit 1 ;;
  esac
}
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod

if [ ! -x "$bin/kube-apiserver" ] || [ ! -x "$bin/kube-controller-manager" ] || [ ! -x "$bin/kubectl" ]; then
  minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  ld="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld="$ld -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
  done
  building "the control plane (kube-apiserver, kube-controller-manager, kubectl)"
  echo "build-bins: building Kubernetes $K8S_VERSION control plane into $bin (first time takes minutes)" >&2
  (cd "$here/k8s-bins" && go build -trimpath -ldflags "$ld" -o "$bin/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kubectl)
fi

if [ "$node" = 1 ] && { [ ! -x "$bin/kubelet" ] || [ ! -x "$bin/kube-scheduler" ]; }; then
  minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  ld="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld="$ld -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
  done
  building "the node's kubelet and kube-scheduler"
  echo "build-bins: building Kubernetes $K8S_VERSION kubelet and kube-scheduler into $bin" >&2
  (cd "$here/k8s-bins" && go build -trimpath -ldflags "$ld" -o "$bin/" \
    k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-scheduler)
fi

if [ "$node" = 1 ] && [ ! -x "$bin/kube-score" ]; then
  building kube-score
  echo "build-bins: building kube-score $KUBE_SCORE_VERSION" >&2
  GOBIN="$bin" go install -trimpath -ldflags "-s -w -X main.version=$KUBE_SCORE_VERSION" \
    "github.com/zegl/kube-score/cmd/kube-score@$KUBE_SCORE_VERSION"
fi

# Helm's own Makefile stamps the Kubernetes version it was built against (its client-go, v0.37:
# 1.37) as the default for `helm template` and `helm lint`; a plain `go install` leaves the source
# default, v1.20, and every chart with a kubeVersion constraint fails to render. The stamp file
# marks a helm built with these flags (older caches are rebuilt once).
HELM_KUBE_MINOR=37
if [ ! -x "$bin/helm" ] || [ ! -f "$bin/.helm-kube-1.$HELM_KUBE_MINOR" ]; then
  building helm
  echo "build-bins: building helm $HELM_VERSION" >&2
  ld="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
  for p in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
    ld="$ld -X $p.k8sVersionMajor=1 -X $p.k8sVersionMinor=$HELM_KUBE_MINOR"
  done
  GOBIN="$bin" go install -trimpath -ldflags "$ld" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  touch "$bin/.helm-kube-1.$HELM_KUBE_MINOR"
fi
echo "$bin"
