#!/bin/bash
# Builds a real kube-apiserver (v1.20.2) from Debian bookworm's "kubernetes" source package, for the
# operator and chart tests. No registry ships a prebuilt apiserver; this takes about 6 minutes on 2 cores
# and 1.8 GB of scratch disk. The binary is cached outside the repository and never committed.
#
# Usage: scripts/ci/build-kube-apiserver.sh [BINDIR]
#   BINDIR defaults to $PREFIXGROVE_K8S_BIN or ~/.cache/prefixgrove/k8s-1.20.2/bin.
#   Also installs etcd-server and kubectl (Debian's kubernetes-client) when missing and running as root.
#   A cached binary that answers --version is reused; FORCE=1 rebuilds.
set -euo pipefail

VERSION=1.20.2
CACHE=${PREFIXGROVE_K8S_CACHE:-$HOME/.cache/prefixgrove/k8s-$VERSION}
BIN=${1:-${PREFIXGROVE_K8S_BIN:-$CACHE/bin}}
mkdir -p "$BIN"

apt_install() {
  if [ "$(id -u)" != 0 ]; then
    echo "missing packages ($*); run as root or install them: apt-get install -y $*" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

command -v etcd >/dev/null || apt_install etcd-server
command -v kubectl >/dev/null || apt_install kubernetes-client

if [ "${FORCE:-0}" != 1 ] && "$BIN/kube-apiserver" --version 2>/dev/null | grep -q "v$VERSION"; then
  echo "kube-apiserver v$VERSION cached at $BIN"
  exit 0
fi

need=()
command -v go >/dev/null || need+=(golang-go)
command -v rsync >/dev/null || need+=(rsync)
command -v jq >/dev/null || need+=(jq)
[ -d /usr/share/gocode/src/github.com/modern-go/reflect2 ] || need+=(golang-github-modern-go-reflect2-dev)
[ ${#need[@]} -eq 0 ] || apt_install "${need[@]}"

WORK=$CACHE/src
rm -rf "$WORK"
mkdir -p "$WORK/lists/partial" "$WORK/parts"
# deb-src entries mirror the machine's own deb entries, in a private apt state so the system's is untouched
sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources > "$WORK/parts/src.sources"
APT_OPTS=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$WORK/parts"
          -o "Dir::State::Lists=$WORK/lists")
apt-get "${APT_OPTS[@]}" update -qq
(cd "$WORK" && apt-get "${APT_OPTS[@]}" source --download-only -qq kubernetes)
tar xzf "$WORK"/kubernetes_*.orig.tar.gz -C "$WORK"
cd "$WORK/kubernetes-$VERSION"
# NOTE: k8s 1.20 vendors reflect2 v1.0.1, which crashes under Go >= 1.18 on the first request; use
# Debian's 1.0.2 instead.
R=/usr/share/gocode/src/github.com/modern-go/reflect2
rm -f vendor/github.com/modern-go/reflect2/*.go vendor/github.com/modern-go/reflect2/*.s
cp "$R"/*.go "$R"/*.s vendor/github.com/modern-go/reflect2/
CGO_ENABLED=0 make WHAT=cmd/kube-apiserver
cp _output/bin/kube-apiserver "$BIN/"
cd /
rm -rf "$WORK"
"$BIN/kube-apiserver" --version
