"""The tests' builders are kube_vgpu.dev.fixtures (shared with the benchmarks and the demo); `pod` is the GPU pod as
kube-scheduler sends it to an extender."""

from __future__ import annotations

from kube_vgpu.dev.fixtures import gpu_node
from kube_vgpu.dev.fixtures import scheduled_pod as pod

__all__ = ["gpu_node", "pod"]
