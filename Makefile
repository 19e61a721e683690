# The two Quick start commands. Both set everything up on a fresh machine (Python deps in a venv,
# Kubernetes binaries built from the official Go modules), cached under ~/.cache/kube-vgpu.
.PHONY: demo test test-oldest-k8s test-prometheus lint bench lock chart
SHELL := /bin/bash
VENV = $(shell scripts/bootstrap.sh)

demo:
	@venv=$$(scripts/bootstrap.sh) && "$$venv/bin/kube-vgpu" demo

test:
	@scripts/system-deps.sh && venv=$$(scripts/bootstrap.sh) && scripts/test.sh "$$venv"

# Opt-in: the end-to-end tier against the oldest Kubernetes release we support (README), built and cached beside
# the default one (another ~12 min of Go builds the first time).
test-oldest-k8s:
	@venv=$$(scripts/bootstrap.sh) && \
	KUBE_VGPU_K8S_VERSION=$$("$$venv/bin/python" -c 'from kube_vgpu.dev.devcluster import binaries as b; print(b.OLDEST_SUPPORTED_KUBERNETES_VERSION)') \
	scripts/test.sh "$$venv" tests/e2e

# The real-Prometheus end-to-end test alone (tests/e2e/test_prometheus_e2e.py, docs/operations.md "Monitoring"): it
# builds Prometheus's server beside promtool the first time, then scrapes a dev cluster with the manifests' monitors.
test-prometheus:
	@venv=$$(scripts/bootstrap.sh) && scripts/test.sh "$$venv" tests/e2e/test_prometheus_e2e.py

lint:
	@venv=$$(scripts/bootstrap.sh) && "$$venv/bin/ruff" check . && "$$venv/bin/mypy"

# Regenerate the Helm chart charts/kube-vgpu from manifests/ after changing either (kube_vgpu/dev/chart.py;
# tests/manifests/test_chart.py fails while they disagree).
chart:
	@venv=$$(scripts/bootstrap.sh) && "$$venv/bin/python" -m kube_vgpu.dev.chart

# Re-resolve the locked dependencies from pyproject.toml (after changing a dependency there); commit both files.
lock:
	@venv=$$(scripts/bootstrap.sh) && \
	"$$venv/bin/uv" pip compile pyproject.toml --universal --python-version 3.11 --generate-hashes -q -o requirements.lock && \
	"$$venv/bin/uv" pip compile pyproject.toml --universal --python-version 3.11 --generate-hashes -q --extra dev --extra sim -o requirements-dev.lock
