#!/usr/bin/env bash
# Installs redis-server (Debian package) when it is missing; the services tests start their own.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  redis-server --version
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
$SUDO apt-get install -y --no-install-recommends redis-server >/dev/null 2>&1 || {
  $SUDO apt-get update >/dev/null
  $SUDO apt-get install -y --no-install-recommends redis-server >/dev/null
}
# The package starts a system-wide server on 6379; the tests never use it.
redis-server --version
