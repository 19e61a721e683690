# The two Quick start commands. Both set everything up on a fresh machine (Python deps in a venv,
# Kubernetes binaries built from the official Go modules), cached under ~/.cache/kube-vgpu.
.PHONY: demo test lint bench lock
SHELL := /bin/bash
VENV = $(shell scripts/bootstrap.sh)

demo:
	@venv=$$(scripts/bootstrap.sh) && "$$venv/bin/kube-vgpu" demo

test:
	@venv=$$(scripts/bootstrap.sh) && scripts/test.sh "$$venv"

lint:
	@venv=$$(scripts/bootstrap.sh) && "$$venv/bin/ruff" check . && "$$venv/bin/mypy"

# Re-resolve the locked dependencies from pyproject.toml (after changing a dependency there); commit both files.
lock:
	@venv=$$(scripts/bootstrap.sh) && \
	"$$venv/bin/uv" pip compile pyproject.toml --universal --python-version 3.11 --generate-hashes -q -o requirements.lock && \
	"$$venv/bin/uv" pip compile pyproject.toml --universal --python-version 3.11 --generate-hashes -q --extra dev --extra sim -o requirements-dev.lock
