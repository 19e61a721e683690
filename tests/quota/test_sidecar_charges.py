"""The quota gate charges a pod what kube-scheduler and Kueue count (kube_vgpu.kubeapi): a native sidecar runs
beside the app containers, so its CPU and its GPUs are charged with theirs (regressions: the gate charged 2000m
for a 1-CPU app with a 2-CPU sidecar, and counted a sidecar's GPU memory as if it ran alone)."""

from __future__ import annotations

from typing import Any

from kube_vgpu import protocol
from kube_vgpu.extender.quota.objects import TOTAL_GPU_CORES, TOTAL_GPU_MEMORY
from kube_vgpu.extender.quota.usage import assignment_usage, pod_info, request_usage_fixed
from tests.quota.helpers import FLAVORS, GPUMEM, a100_node, local_queue, make_env, queued_pod

CPU_QUOTA = FLAVORS + """
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: ClusterQueue
metadata: {name: team-a}
spec:
  namespaceSelector: {}
  resourceGroups:
  - coveredResources: [cpu, nvidia.com/gpu, nvidia.com/gpumem]
    flavors:
    - name: a100
      resources:
      - {name: cpu, nominalQuota: "4"}
      - {name: nvidia.com/gpu, nominalQuota: 8}
      - {name: nvidia.com/gpumem, nominalQuota: 200000}
""" + local_queue("team-a", "q", "team-a")


def with_sidecar(pod: dict[str, Any], *, cpu: str, gpu_memory_mib: int | None = None) -> dict[str, Any]:
    limits: dict[str, str] = {"cpu": cpu}
    if gpu_memory_mib is not None:
        limits |= {protocol.RESOURCE_GPU: "1", protocol.RESOURCE_GPU_MEMORY: str(gpu_memory_mib)}
    pod["spec"]["initContainers"] = [
        {"name": "proxy", "image": "envoy", "restartPolicy": "Always", "resources": {"limits": limits}}]
    return pod


def test_a_sidecars_cpu_is_charged_beside_the_app_container() -> None:
    pod = with_sidecar(queued_pod("q", gpus=1, memory_mib=1000), cpu="2")  # app container: cpu 1
    assert pod_info(pod, 0.0).cpu_milli == 3000


def test_an_init_container_larger_than_the_app_phase_is_charged_at_its_peak_with_overhead() -> None:
    pod = queued_pod("q", gpus=1, memory_mib=1000)
    pod["spec"]["initContainers"] = [{"name": "warm", "image": "x", "resources": {"limits": {"cpu": "5"}}}]
    pod["spec"]["overhead"] = {"cpu": "250m"}
    assert pod_info(pod, 0.0).cpu_milli == 5250


def test_the_cpu_budget_refuses_a_second_sidecar_pod() -> None:
    env = make_env(CPU_QUOTA, [a100_node("a100-0")])
    first = with_sidecar(queued_pod("q", gpus=1, memory_mib=1000), cpu="2")
    assert env.submit(first) == "a100-0"
    assert env.used("team-a", "a100", "cpu") == 3000
    second = with_sidecar(queued_pod("q", gpus=1, memory_mib=1000), cpu="2")
    outcome = env.submit(second)
    assert not isinstance(outcome, str), "4 CPUs of quota cannot hold two pods of 3 CPUs each"
    assert "cpu: needs 3000" in next(iter(outcome.failed.values()))


def test_a_sidecars_gpu_memory_is_charged_with_the_app_containers() -> None:
    env = make_env(CPU_QUOTA, [a100_node("a100-0")])
    pod = with_sidecar(queued_pod("q", gpus=1, memory_mib=40960), cpu="100m", gpu_memory_mib=20480)
    request = protocol.parse_pod_gpu_request(pod)
    assert request_usage_fixed(request) == {protocol.RESOURCE_GPU: 2, GPUMEM: 61440, protocol.RESOURCE_GPU_CORES: 0,
                                            TOTAL_GPU_MEMORY: 61440, TOTAL_GPU_CORES: 0}
    assert env.submit(pod) == "a100-0"
    assert env.used("team-a", "a100", GPUMEM) == 61440
    record = env.state.pods[pod["metadata"]["uid"]]
    assert assignment_usage(record.assignment)[GPUMEM] == 61440
