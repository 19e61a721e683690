"""What one /metrics render costs the extender's process, in-process (issue 18): CPU seconds of the render (the
kept text warm, then after --binds binds through the real verbs, as between two scrapes of a busy cluster), and
its steps: the thread CPU between two pause() calls, which is how long a verb that arrives during a step waits for
it (VerbActivity's turn). No HTTP and no other process: steadier than bench/scrape_cost.py on a shared machine, and
it says where the render's time goes, not what the verbs' latency does.

    PYTHONPATH=. python bench/render_cost.py                   # 5000 nodes x 8 GPUs, 40,000 pods, 1500 binds
    PYTHONPATH=. python bench/render_cost.py --nodes 500 --binds 100 --profile
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import sys
import tempfile
import time
import traceback
from pathlib import Path

import orjson

from bench.extender_latency import half_full_cluster, shapes
from bench.scrape_cost import with_bind_times
from kube_vgpu.dev.fixtures import scheduled_pod as make_pod
from kube_vgpu.extender.cli import Extender, build, parse_args
from kube_vgpu.extender.exposition import render_registry, render_settings


class StepClock:
    """A pause() that measures the thread CPU since the previous call: the render's steps, by where they end."""

    def __init__(self, over_s: float) -> None:
        self.over_s = over_s
        self.steps = 0
        self.longest_s = 0.0
        #: where a step over over_s ended (the caller of pause()) -> [count, CPU s, longest s]
        self.long: dict[str, list[float]] = {}
        self._last_s: float | None = None

    def start(self) -> None:
        """A render begins: its first step starts now."""
        self._last_s = time.thread_time()

    def __call__(self) -> None:
        now_s = time.thread_time()
        if self._last_s is not None:
            step_s = now_s - self._last_s
            self.steps += 1
            self.longest_s = max(self.longest_s, step_s)
            if step_s > self.over_s:
                frames = traceback.extract_stack(limit=4)[:-1]
                where = " < ".join(f"{frame.name}:{frame.lineno}" for frame in reversed(frames))
                entry = self.long.setdefault(where, [0, 0.0, 0.0])
                entry[0] += 1
                entry[1] += step_s
                entry[2] = max(entry[2], step_s)
        self._last_s = time.thread_time()  # not counting this function's own bookkeeping


def bind_pods(built: Extender, names: list[str], count: int) -> None:
    """filter, prioritize and bind `count` 1-GPU fractional pods through the extender's verbs (no HTTP)."""
    verbs = built.app.verbs
    shape = shapes()["1-gpu-fractional"]
    for _ in range(count):
        pod = make_pod(**shape)
        passed = verbs["/filter"]({"Pod": pod, "NodeNames": names})["NodeNames"]
        scores = verbs["/prioritize"]({"Pod": pod, "NodeNames": passed})
        if not scores:
            continue
        meta = pod["metadata"]
        bound = verbs["/bind"]({"PodName": meta["name"], "PodNamespace": "default", "PodUID": meta["uid"],
                                "Node": max(scores, key=lambda s: s["Score"])["Host"]})
        if inspect.isawaitable(bound):
            asyncio.run(bound)  # type: ignore[arg-type]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--binds", type=int, default=1500, help="pods bound between two measured renders")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--step-over-ms", type=float, default=0.3, help="list the steps longer than this")
    parser.add_argument("--profile", action="store_true", help="cProfile one more render after binds")
    args = parser.parse_args()

    items = with_bind_times(half_full_cluster(args.nodes))
    names = [item["metadata"]["name"] for item in items if item["kind"] == "Node"]
    with tempfile.TemporaryDirectory() as tmp:
        snapshot = Path(tmp) / "snapshot.json"
        snapshot.write_bytes(orjson.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
        del items
        built = build(parse_args(["--snapshot", str(snapshot)]))
    registry = built.app.state.registry

    def render(pause: StepClock | None = None) -> tuple[float, int]:
        with render_settings():
            if pause is not None:
                pause.start()
            started_s = time.thread_time()
            body = render_registry(registry, pause or (lambda: None))
            return time.thread_time() - started_s, sum(map(len, body))

    print(f"# render cost: {args.nodes} nodes x 8 GPUs, {len(built.state.pods)} pods")
    built_rss_mib = rss_mib()
    for label in ("first render (all text new)", "again, nothing changed"):
        cpu_s, size = render()
        print(f"{label:28s} CPU {cpu_s * 1e3:4.0f} ms, {size / 1e6:.1f} MB")
    print(f"RSS: {built_rss_mib:.0f} MiB with the state built, {rss_mib():.0f} MiB after two renders (the text kept "
          f"between scrapes; the bodies are freed)")
    clock = StepClock(args.step_over_ms / 1e3)
    for _ in range(args.rounds):
        bind_pods(built, names, args.binds)
        cpu_s, size = render()  # its CPU without the step clock's own cost
        print(f"{f'after {args.binds} binds':28s} CPU {cpu_s * 1e3:4.0f} ms, {size / 1e6:.1f} MB")
        bind_pods(built, names, args.binds)
        render(clock)  # the same work again, its steps measured
    print(f"steps of {args.rounds} renders after {args.binds} binds: {clock.steps}, the longest "
          f"{clock.longest_s * 1e3:.2f} ms; over {args.step_over_ms} ms, by where they end:")
    for where, (count, total_s, longest_s) in sorted(clock.long.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"  {int(count):5d} x, {total_s * 1e3:7.1f} ms, longest {longest_s * 1e3:5.2f} ms  {where}")
    if args.profile:
        import cProfile
        import pstats

        bind_pods(built, names, args.binds)
        profile = cProfile.Profile()
        profile.enable()
        render()
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)
    return 0


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


if __name__ == "__main__":
    sys.exit(main())
