#!/usr/bin/env bash
# Runs the whole test suite (unit, HTTP, gRPC, end-to-end against a real control plane) and the linters.
set -euo pipefail
venv=$1
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
echo ">> ruff"
"$venv/bin/ruff" check .
echo ">> mypy"
"$venv/bin/mypy"
echo ">> pytest"
"$venv/bin/python" -m pytest -q -p no:cacheprovider "${@:2}"
