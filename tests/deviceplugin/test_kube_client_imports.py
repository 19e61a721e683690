"""The device plugin's API client leaves the generated core/v1 API and models unimported (~21 MiB of resident
memory on every GPU node): a fresh interpreter builds it as `kube-vgpu device-plugin` does. Its calls are checked
against the real API server in tests/e2e/test_deviceplugin_kube_client.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
from kubernetes import client
import kube_vgpu.deviceplugin.cli
from kube_vgpu.deviceplugin.kube import KubeClient
KubeClient(client.ApiClient(), host="node-1")
prefixes = ("kubernetes.client.api.core_v1", "kubernetes.client.models.v1_pod", "kubernetes.client.models.v1_node",
            "kubernetes.client.models.core_v1_event")
print(sorted(m for m in sys.modules if m.startswith(prefixes)))
"""


def test_the_device_plugins_client_imports_no_generated_core_api_or_model() -> None:
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
