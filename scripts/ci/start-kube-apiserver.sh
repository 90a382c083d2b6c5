#!/bin/bash
# Starts etcd (Debian's etcd-server) and kube-apiserver (built by build-kube-apiserver.sh) on loopback,
# with token authentication and RBAC, and writes an admin kubeconfig. Both run in the background; their
# pids are in RUN_DIR/{etcd,apiserver}.pid and their logs beside them. There is no scheduler or kubelet:
# pods never run, objects and status are all there is.
#
# Environment (all optional):
#   K8S_RUN_DIR   state, certs, logs, kubeconfig (default /tmp/prefixgrove-k8s); wiped first
#   K8S_BIN       holds kube-apiserver (default $PREFIXGROVE_K8S_BIN or ~/.cache/prefixgrove/k8s-1.20.2/bin)
#   ETCD_PORT ETCD_PEER_PORT API_PORT   loopback ports (default 12379 12380 16443)
#   K8S_TOKEN     the admin bearer token (default: random)
#   KUBECTL       kubectl for the readiness probe when curl is missing (default: kubectl on PATH)
# Prints the kubeconfig path on success; exits 1 (with the apiserver log's tail) when it never gets ready.
set -euo pipefail

D=${K8S_RUN_DIR:-/tmp/prefixgrove-k8s}
BIN=${K8S_BIN:-${PREFIXGROVE_K8S_BIN:-$HOME/.cache/prefixgrove/k8s-1.20.2/bin}}
ETCD_PORT=${ETCD_PORT:-12379}
ETCD_PEER_PORT=${ETCD_PEER_PORT:-12380}
API_PORT=${API_PORT:-16443}
TOKEN=${K8S_TOKEN:-$(openssl rand -hex 16)}

[ -x "$BIN/kube-apiserver" ] || { echo "no kube-apiserver in $BIN: run scripts/ci/build-kube-apiserver.sh" >&2; exit 1; }
command -v etcd >/dev/null || { echo "no etcd on PATH: apt-get install -y etcd-server" >&2; exit 1; }

rm -rf "$D"
mkdir -p "$D/certs"
openssl genrsa -out "$D/sa.key" 2048 2>/dev/null
echo "$TOKEN,admin,admin,system:masters" > "$D/tokens.csv"

# setsid: the daemons outlive this script and are stopped by pid, never by name
setsid etcd --data-dir "$D/etcd" --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster "default=http://127.0.0.1:$ETCD_PEER_PORT" \
  --unsafe-no-fsync >"$D/etcd.log" 2>&1 < /dev/null &
echo $! > "$D/etcd.pid"

setsid "$BIN/kube-apiserver" --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
  --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$API_PORT" \
  --cert-dir="$D/certs" --token-auth-file="$D/tokens.csv" --authorization-mode=RBAC \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$D/sa.key" --service-account-signing-key-file="$D/sa.key" \
  --service-cluster-ip-range=10.0.0.0/24 --disable-admission-plugins=ServiceAccount \
  --allow-privileged=true >"$D/apiserver.log" 2>&1 < /dev/null &
echo $! > "$D/apiserver.pid"

cat > "$D/kubeconfig" <<KC
apiVersion: v1
kind: Config
# the apiserver writes a self-signed certificate and its CA into this one file when it starts
clusters: [{name: local, cluster: {server: "https://127.0.0.1:$API_PORT", certificate-authority: "$D/certs/apiserver.crt"}}]
users: [{name: admin, user: {token: "$TOKEN"}}]
contexts: [{name: local, context: {cluster: local, user: admin, namespace: default}}]
current-context: local
KC

ready() {
  if command -v curl >/dev/null; then
    curl -sf --cacert "$D/certs/apiserver.crt" -H "Authorization: Bearer $TOKEN" \
      "https://127.0.0.1:$API_PORT/readyz" >/dev/null 2>&1
  else
    "${KUBECTL:-kubectl}" --kubeconfig "$D/kubeconfig" get --raw=/readyz >/dev/null 2>&1
  fi
}
for _ in $(seq 1 300); do
  if ready; then
    echo "$D/kubeconfig"
    exit 0
  fi
  sleep 0.2
done
echo "kube-apiserver did not become ready on port $API_PORT" >&2
tail -30 "$D/apiserver.log" >&2
exit 1
