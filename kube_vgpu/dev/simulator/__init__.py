"""Trace-driven placement simulator (openb traces, FGD methodology) on the extender's own placement engine."""

from kube_vgpu.dev.simulator.engine import RunResult, build_node, build_request, simulate
from kube_vgpu.dev.simulator.metrics import curve, mean_curve
from kube_vgpu.dev.simulator.trace import NodeSpec, Task, arrival_sequence, load_nodes, load_tasks

__all__ = [
    "NodeSpec",
    "RunResult",
    "Task",
    "arrival_sequence",
    "build_node",
    "build_request",
    "curve",
    "load_nodes",
    "load_tasks",
    "mean_curve",
    "simulate",
]
