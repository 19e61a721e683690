#!/usr/bin/env bash
# Creates (once) the project's virtual environment under the user's cache directory, keyed by the
# Python version and the hashes of pyproject.toml and requirements-dev.lock, and installs in it exactly the locked
# dependencies (hash-checked), then kube-vgpu itself (editable, no dependency resolution of its own).
# Prints the venv path on stdout; progress goes to stderr.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache="${XDG_CACHE_HOME:-$HOME/.cache}/kube-vgpu"
python=${PYTHON:-python3}
"$python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' || {
  echo "kube-vgpu needs Python >= 3.11 (found $("$python" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2; exit 1; }
key=$( (cat "$root/pyproject.toml" "$root/requirements-dev.lock"; "$python" --version 2>&1; echo "$root") | sha256sum | cut -c1-12)
venv="$cache/venv-$key"
if [ ! -f "$venv/.complete" ]; then
  echo ">> creating virtual environment $venv (first run only)" >&2
  rm -rf "$venv"
  mkdir -p "$cache"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q --require-hashes -r "$root/requirements-dev.lock" >&2
  "$venv/bin/python" -m pip install -q --no-deps -e "$root" >&2
  touch "$venv/.complete"
fi
echo "$venv"
