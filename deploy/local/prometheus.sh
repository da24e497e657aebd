#!/usr/bin/env bash
# Prometheus for the local cluster: scrapes every pod with a container port named "metrics" through
# Kubernetes service discovery against the local API server, with graphkeeper's recording and
# alerting rules loaded. The binary is built from the Go module proxy by build-promtool.sh --server
# (Debian's prometheus package leaves Kubernetes service discovery out), here when it is missing
# unless GRAPHKEEPER_NO_BUILD=1 (then it must be built already, as .ci/run and make test-e2e do).
#
#   deploy/local/prometheus.sh up NAMESPACE...   start (or reload) it, scraping those namespaces
#   deploy/local/prometheus.sh down              stop it
#
# Environment: GRAPHKEEPER_CLUSTER_DIR (the cluster's state, as for cluster.sh),
# GRAPHKEEPER_APISERVER_PORT (16443), GRAPHKEEPER_PROMETHEUS_PORT (29090).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
state=${GRAPHKEEPER_CLUSTER_DIR:-$HOME/.cache/graphkeeper/cluster}
api_port=${GRAPHKEEPER_APISERVER_PORT:-16443}
port=${GRAPHKEEPER_PROMETHEUS_PORT:-29090}
pidfile=$state/run/prometheus.pid

up() {
  [ "$#" -gt 0 ] || { echo "usage: $0 up NAMESPACE..." >&2; exit 2; }
  local prometheus
  prometheus=$("$here/build-promtool.sh" --server | tail -n 1)
  local pki=$state/pki names
  names=$(printf '%s, ' "$@"); names="[${names%, }]"
  mkdir -p "$state/prometheus" "$state/logs" "$state/run"
  cat >"$state/prometheus/prometheus.yml" <<YAML
global:
  scrape_interval: 5s
  evaluation_interval: 5s
rule_files:
  - $root/deploy/prometheus/graphkeeper-alerts.yaml
scrape_configs:
  # Every pod with a container port named "metrics" (the workers and the operator); namespace and
  # pod become target labels, as the dashboard and the rules expect.
  - job_name: graphkeeper-pods
    kubernetes_sd_configs:
      - role: pod
        api_server: https://127.0.0.1:$api_port
        namespaces: {names: $names}
        tls_config: {ca_file: $pki/ca.crt, cert_file: $pki/admin.crt, key_file: $pki/admin.key}
    # graphkeeper_operator_workers carries the policy's own namespace label: keep it.
    honor_labels: true
    relabel_configs:
      - {source_labels: [__meta_kubernetes_pod_container_port_name], regex: metrics, action: keep}
      - {source_labels: [__meta_kubernetes_namespace], target_label: namespace}
      - {source_labels: [__meta_kubernetes_pod_name], target_label: pod}
      - {source_labels: [__meta_kubernetes_pod_container_name], target_label: container}
YAML
  if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    kill -HUP "$(cat "$pidfile")"
  else
    if { command -v ss >/dev/null 2>&1 && [ -n "$(ss -Hltn "sport = :$port" 2>/dev/null)" ]; } \
       || (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      echo "prometheus: port $port already in use by another process; set GRAPHKEEPER_PROMETHEUS_PORT" >&2
      return 1
    fi
    setsid "$prometheus" --config.file "$state/prometheus/prometheus.yml" \
      --storage.tsdb.path "$state/prometheus/data" --storage.tsdb.retention.time 1d \
      --web.listen-address "127.0.0.1:$port" >"$state/logs/prometheus.log" 2>&1 </dev/null &
    echo $! >"$pidfile"
  fi
  local i
  for i in $(seq 100); do
    curl -fsS "http://127.0.0.1:$port/-/ready" >/dev/null 2>&1 && { echo "http://127.0.0.1:$port"; return; }
    sleep 0.2
  done
  echo "prometheus did not become ready; see $state/logs/prometheus.log" >&2
  tail -n 20 "$state/logs/prometheus.log" >&2
  return 1
}

down() {
  local pid
  [ -f "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}

case "${1:-}" in
  up) shift; up "$@" ;;
  down) down ;;
  *) echo "usage: $0 up NAMESPACE...|down" >&2; exit 2 ;;
esac
