"""openb-style trace files (node list and task list CSVs) and the arrival sequence of one experiment.

Node CSV columns: `sn` (node name), `cpu_milli`, `memory_mib`, `gpu` (GPU count), `model` (GPU model).
Task CSV columns: `name`, `cpu_milli`, `memory_mib`, `num_gpu`, `gpu_milli` (per GPU, 1000 = whole GPU),
optional `gpu_spec` (allowed models joined by `|`); other columns are ignored.
"""

from __future__ import annotations

import csv
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kube_vgpu.extender.engine.fragmentation import MILLI_PER_GPU, TaskShape


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    cpu_milli: int
    memory_mib: int
    gpu_count: int
    model: str


@dataclass(frozen=True, slots=True)
class Task:
    name: str
    cpu_milli: int
    memory_mib: int
    gpu_count: int
    gpu_milli: int  # per GPU
    gpu_spec: tuple[str, ...] = ()

    @property
    def gpu_milli_total(self) -> int:
        return self.gpu_count * self.gpu_milli

    @property
    def key(self) -> tuple[int, int, int, int, tuple[str, ...]]:
        """Everything placement depends on (tasks with equal keys are interchangeable)."""
        return (self.cpu_milli, self.memory_mib, self.gpu_count, self.gpu_milli, self.gpu_spec)

    @property
    def shape(self) -> TaskShape:
        return TaskShape(self.cpu_milli, self.gpu_milli if self.gpu_count else 0, self.gpu_count, self.gpu_spec)


@dataclass(frozen=True, slots=True)
class TimedTask:
    """A task with its lifetime in the trace (seconds): it exists on [created, deleted)."""

    task: Task
    created: int
    deleted: int


class TraceError(ValueError):
    pass


def _int(row: dict[str, str], column: str, where: str) -> int:
    try:
        return int(float(row[column]))
    except KeyError:
        raise TraceError(f"{where}: missing column {column!r}") from None
    except ValueError:
        raise TraceError(f"{where}: column {column!r} is not a number: {row[column]!r}") from None


def load_nodes(path: str | Path) -> list[NodeSpec]:
    nodes = []
    with open(path, newline="") as handle:
        for number, row in enumerate(csv.DictReader(handle), start=2):
            where = f"{path}:{number}"
            nodes.append(
                NodeSpec(
                    name=row.get("sn") or row.get("name") or f"node-{number - 2}",
                    cpu_milli=_int(row, "cpu_milli", where),
                    memory_mib=_int(row, "memory_mib", where),
                    gpu_count=_int(row, "gpu", where),
                    model=(row.get("model") or "").strip(),
                )
            )
    if not nodes:
        raise TraceError(f"{path}: no nodes")
    return nodes


def load_tasks(path: str | Path) -> list[Task]:
    tasks = []
    with open(path, newline="") as handle:
        for number, row in enumerate(csv.DictReader(handle), start=2):
            where = f"{path}:{number}"
            count = _int(row, "num_gpu", where)
            milli = _int(row, "gpu_milli", where) if count else 0
            if count and not 0 < milli <= MILLI_PER_GPU:
                raise TraceError(f"{where}: gpu_milli must be 1..{MILLI_PER_GPU} for a GPU task, got {milli}")
            if count > 1 and milli < MILLI_PER_GPU:
                raise TraceError(f"{where}: multi-GPU tasks must ask whole GPUs (gpu_milli {MILLI_PER_GPU})")
            spec = tuple(part for part in (row.get("gpu_spec") or "").strip().split("|") if part)
            tasks.append(
                Task(
                    name=row.get("name") or f"task-{number - 2}",
                    cpu_milli=_int(row, "cpu_milli", where),
                    memory_mib=_int(row, "memory_mib", where),
                    gpu_count=count,
                    gpu_milli=milli,
                    gpu_spec=spec,
                )
            )
    if not tasks:
        raise TraceError(f"{path}: no tasks")
    return tasks


def load_timed_tasks(path: str | Path) -> list[TimedTask]:
    """The tasks with their `creation_time` and `deletion_time` columns (the churn protocol)."""
    tasks = load_tasks(path)
    timed = []
    with open(path, newline="") as handle:
        for number, (row, task) in enumerate(zip(csv.DictReader(handle), tasks, strict=True), start=2):
            where = f"{path}:{number}"
            timed.append(TimedTask(task, _int(row, "creation_time", where), _int(row, "deletion_time", where)))
    return timed


#: the public openb traces, beside a checkout (../shared/traces/openb) or at the workplace's shared folder
_OPENB_FOLDERS = (Path(__file__).resolve().parents[3].parent / "shared" / "traces" / "openb",
                  Path("/work/shared/traces/openb"))


def openb_trace_folders() -> list[Path]:
    """Where the openb traces are looked for, in order, each once: $KUBE_VGPU_OPENB_TRACES, then _OPENB_FOLDERS."""
    named = os.environ.get("KUBE_VGPU_OPENB_TRACES", "")
    return list(dict.fromkeys([*([Path(named)] if named else []), *_OPENB_FOLDERS]))


def find_openb_traces() -> Path | None:
    """The first of openb_trace_folders() holding the traces' node list; None where none does."""
    return next((folder for folder in openb_trace_folders() if (folder / "openb_node_list_gpu_node.csv").is_file()),
                None)


def trace_name(pod_csv: str | Path) -> str:
    """"openb_pod_list_gpushare40.csv" -> "gpushare40"."""
    stem = Path(pod_csv).stem
    return stem.split("pod_list_", 1)[1] if "pod_list_" in stem else stem


def arrival_sequence(tasks: Sequence[Task], capacity_milli: int, seed: int, inflate: float = 1.3) -> list[Task]:
    """One experiment's arrivals (METHOD.md step 2): shuffle the whole trace; then, while the total GPU ask is
    below inflate x capacity, append tasks drawn uniformly with replacement from the whole trace (CPU-only ones
    included), stopping at the first draw that would pass the target (as the reference does); if the trace
    already asks more, remove random tasks until the total is at or under the target."""
    rng = random.Random(seed)
    order = list(tasks)
    rng.shuffle(order)
    target = inflate * capacity_milli
    total = sum(task.gpu_milli_total for task in order)
    if total > target:
        while total > target and order:
            total -= order.pop(rng.randrange(len(order))).gpu_milli_total
        return order
    if not any(task.gpu_milli_total for task in tasks):
        return order  # nothing to inflate with
    while True:
        task = tasks[rng.randrange(len(tasks))]
        if total + task.gpu_milli_total > target:
            return order
        order.append(task)
        total += task.gpu_milli_total
