"""What a Prometheus scrape of /metrics and a dashboard polling GET /state cost kube-scheduler's verbs on a big
cluster (issue 18): filter and prioritize latency over HTTP while nothing else is asked of the extender, against
the same verbs while /metrics is scraped and while /state is polled, in one run against one extender process.

The cluster is bench/extender_latency.py's: N nodes x 8 A100-80GB, 8 bound 1-GPU pods per node at ~50% (40,000
pods at 5000 nodes), each carrying a bind time so the per-pod GPU-seconds counters are exported as in a live
cluster. Each phase runs the same loop for --seconds: a 1-GPU fractional pod filtered over every node, prioritized
over the nodes that passed, bound to the best one (so per-node caches are invalidated as in production). The
phases run --rounds times, interleaved (every other round in reverse), and each is summarised over its rounds. Phases:

  * baseline: nothing else;
  * metrics-every-Ns: GET /metrics on the metrics listener every --scrape-interval-s (a 15-30 s Prometheus interval
    compressed into the run);
  * metrics-continuous: GET /metrics back to back (worst case: several Prometheus replicas and a slow scraper);
  * state-every-Ns: GET /state on the verbs' port every --state-interval-s (a dashboard without its stretch rule);
  * dashboard: the dashboard's own upstream reader (kube_vgpu.extender.dashboard.server.Upstream, as `kube-vgpu
    dashboard` runs it) asked by one open page every 2 s: coalesced, the interval stretched to 10x a read's time;
  * quota is not polled: with no quota gate (no --quota-config) it is a 404.

The scraper runs in its own process (as Prometheus would), reading each reply whole. Printed: each phase's filter
and prioritize p50/p99, its p99 over the first baseline's and its slowest request (the client is sequential, as
kube-scheduler's scheduling cycle is: a stall of the server delays one request, so p99 counts how often a verb
meets one and max how long it lasts); each endpoint's reply size and time (alone, before
the phases; that is the extender's generation time plus the transfer over loopback).

    PYTHONPATH=. python bench/scrape_cost.py                      # 5000 nodes, 4 rounds of 8 s per phase
    PYTHONPATH=. python bench/scrape_cost.py --nodes 500 --seconds 3 --rounds 1
    PYTHONPATH=. python bench/scrape_cost.py --rounds 10 --seconds 30 --scrape-interval-s 15   # the long version
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import multiprocessing
import multiprocessing.synchronize
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from bench.extender_latency import half_full_cluster, percentile, rss_mib, shapes
from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import scheduled_pod as make_pod

ROOT = Path(__file__).resolve().parent.parent
JSON_HEADERS = {"Content-Type": "application/json"}


def with_bind_times(items: list[dict[str, Any]], max_hours_ago: float = 24.0, seed: int = 7) -> list[dict[str, Any]]:
    """Give every bound pod a bind time, as the extender's bind writes it: the GPU-seconds counters need one. Each
    its own (up to max_hours_ago), as in a live cluster: the counters' values then all differ, as they do there."""
    rng = random.Random(seed)
    now = dt.datetime.now(dt.UTC)
    for item in items:
        if item["kind"] == "Pod" and item["spec"].get("nodeName"):
            bound = now - dt.timedelta(seconds=rng.uniform(60.0, max_hours_ago * 3600.0))
            item["metadata"].setdefault("annotations", {})[protocol.POD_BIND_TIME_ANNOTATION] = \
                protocol.format_bind_time(bound)
    return items


_READ_BUFFER = memoryview(bytearray(1 << 20))


def fetch(port: int, path: str, timeout_s: float = 120.0) -> tuple[int, float, float, float]:
    """GET path -> (bytes, seconds to the first byte of the reply, seconds to the last, when it started on the
    monotonic clock, which is the same in every process)."""
    began = time.monotonic()
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        connection.request("GET", path)
        reply = connection.getresponse()
        first_s = time.perf_counter() - started
        # into one reused buffer: a fresh 95 MB bytes object per poll cost this process (on the same 2 cores as the
        # extender and the client) the page faults of 95 MB every scrape, which a Prometheus elsewhere does not
        # charge the extender's machine
        size = 0
        while count := reply.readinto(_READ_BUFFER):
            size += count
        if reply.status != 200:
            raise RuntimeError(f"GET {path}: {reply.status}")
        return size, first_s, time.perf_counter() - started, began
    finally:
        connection.close()


def poll(port: int, path: str, interval_s: float, stop: multiprocessing.synchronize.Event,
         results: Any, niceness: int = 0) -> None:
    """GET path every interval_s (0: back to back) until stop; each (bytes, first-byte s, total s) onto results.
    A request taking longer than the interval is followed at once by the next, as Prometheus does not do (it skips
    a beat), so a too-slow endpoint shows as back-to-back requests: worst case, on purpose. niceness: this process'
    CPU priority lowered by that much (a Prometheus runs on another machine; here it shares the 2 cores)."""
    if niceness:
        os.nice(niceness)
    samples = []
    next_s = time.monotonic()
    while not stop.is_set():
        samples.append(fetch(port, path))
        next_s += interval_s
        stop.wait(max(0.0, next_s - time.monotonic()))
    results.put(samples)


def dashboard_poll(port: int, page_interval_s: float, stop: multiprocessing.synchronize.Event,
                   results: Any) -> None:
    """The dashboard's real upstream (kube_vgpu.extender.dashboard: coalesced reads, the interval stretched to keep
    the extender busy at most busy_share of the time) asked by one open page every page_interval_s (the page's own
    poll); each upstream read as (0, 0, its seconds) onto results."""
    import asyncio

    from kube_vgpu.extender.dashboard.server import Upstream

    upstream = Upstream(f"http://127.0.0.1:{port}", timeout_s=120)
    samples = []
    while not stop.is_set():
        before, started = upstream.fetches, time.monotonic()
        asyncio.run(upstream.view())
        if upstream.fetches > before:
            samples.append((0, 0.0, time.monotonic() - started, started))
        stop.wait(page_interval_s)
    results.put(samples)


def cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds (user, system) a process has used so far: a scrape's cost in CPU, which on a loaded machine is
    steadier than the verbs' latency (system time: its sockets, and the page faults of memory handed back)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / os.sysconf("SC_CLK_TCK"), int(fields[12]) / os.sysconf("SC_CLK_TCK")


def wait_ready(port: int, server: subprocess.Popen[bytes], deadline_s: float = 600.0) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/readyz")
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline or server.poll() is not None:
            raise RuntimeError("extender did not become ready")
        time.sleep(0.5)


def run_pods(connection: http.client.HTTPConnection, names: list[str], seconds: float,
             starts: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """filter + prioritize + bind one pod after another for `seconds`; the verbs' round trips in seconds (and, into
    `starts`, when each began on the monotonic clock)."""
    timings: dict[str, list[float]] = {"filter": [], "prioritize": []}
    began = starts if starts is not None else {"filter": [], "prioritize": []}
    shape = shapes()["1-gpu-fractional"]
    end = time.monotonic() + seconds

    def post(path: str, body: bytes) -> Any:
        connection.request("POST", path, body=body, headers=JSON_HEADERS)
        return orjson.loads(connection.getresponse().read())

    while time.monotonic() < end:
        pod = make_pod(**shape)
        began["filter"].append(time.monotonic())
        started = time.perf_counter()
        passed = post("/filter", orjson.dumps({"Pod": pod, "NodeNames": names}))["NodeNames"]
        timings["filter"].append(time.perf_counter() - started)
        began["prioritize"].append(time.monotonic())
        started = time.perf_counter()
        scores = post("/prioritize", orjson.dumps({"Pod": pod, "NodeNames": passed}))
        timings["prioritize"].append(time.perf_counter() - started)
        if scores:
            meta = pod["metadata"]
            best = max(scores, key=lambda s: s["Score"])["Host"]
            post("/bind", orjson.dumps({"PodName": meta["name"], "PodNamespace": "default", "PodUID": meta["uid"],
                                        "Node": best}))
    return timings


def print_tails(timeline: list[dict[str, Any]]) -> None:
    """Where the slow verbs are: for each polled phase, filter's p99 over the verbs that ran while a poll was
    being answered and over the others, and how many of the phase's slowest 1% fall in each."""
    print("\nfilter during polls vs not (a poll's window: from its GET to the end of its reply)")
    by_label: dict[str, list[dict[str, Any]]] = {}
    for entry in timeline:
        by_label.setdefault(entry["phase"], []).append(entry)
    for label, entries in by_label.items():
        inside: list[float] = []
        outside: list[float] = []
        rendering: list[float] = []  # a verb that met a reply before its first byte: the render
        for entry in entries:
            windows = sorted((began, began + first_s, began + total_s) for began, total_s, first_s in entry["requests"])
            for began, seconds in entry["verbs"]["filter"]:
                during = any(start <= began + seconds and began <= end for start, _, end in windows)
                (inside if during else outside).append(seconds)
                if any(start <= began + seconds and began <= first for start, first, _ in windows):
                    rendering.append(seconds)
        every = sorted(inside + outside)
        if not every or not inside:
            continue
        slow_s = every[int(len(every) * 0.99)]
        # back-to-back polls (metrics-continuous) may leave no verb outside every poll's window
        outside_text = (f"p50 {percentile(outside, 50) * 1e3:5.2f} p99 {percentile(outside, 99) * 1e3:6.2f} ms, "
                        f"{sum(s >= slow_s for s in outside)} of them") if outside else "none"
        print(f"  {label:22s} during: {len(inside):5d} verbs, p50 {percentile(inside, 50) * 1e3:5.2f} p99 "
              f"{percentile(inside, 99) * 1e3:6.2f} ms, {sum(s >= slow_s for s in inside)} of the slowest 1%; "
              f"outside: {len(outside):5d}, {outside_text}")
        if rendering:
            print(f"  {'':22s} of those during, before the reply's first byte (the render): {len(rendering)} verbs, "
                  f"p50 {percentile(rendering, 50) * 1e3:5.2f} p99 {percentile(rendering, 99) * 1e3:6.2f} ms, "
                  f"{sum(s >= slow_s for s in rendering)} of the slowest 1%")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each phase in each round")
    parser.add_argument("--rounds", type=int, default=4,
                        help="the phases run this many times, interleaved (every other round reversed), and are "
                             "summarised over all rounds (the load and the cluster's fill drift through a run: "
                             "interleaving spreads the drift over every phase); an even number cancels a steady drift")
    parser.add_argument("--scrape-interval-s", type=float, default=2.0)
    parser.add_argument("--state-interval-s", type=float, default=1.0)
    parser.add_argument("--phases", nargs="+",
                        default=["baseline", "metrics-interval", "metrics-continuous", "state-interval"],
                        choices=["baseline", "metrics-interval", "metrics-continuous", "state-interval", "dashboard"])
    parser.add_argument("--extender-arg", action="append", default=[],
                        help="extra argument for `kube-vgpu extender` (repeatable), e.g. "
                             "--extender-arg=--metrics-per-pod-gpu=off")
    parser.add_argument("--poller-nice", type=int, default=0,
                        help="lower the /metrics and /state pollers' CPU priority by this much (os.nice): a Prometheus "
                             "runs on another machine, here it shares the cores with the extender and the client")
    parser.add_argument("--timeline", default="",
                        help="write every verb's start and seconds and every poll's start and seconds, per phase "
                             "and round, to this JSON file")
    args = parser.parse_args()

    started = time.perf_counter()
    items = with_bind_times(half_full_cluster(args.nodes))
    names = [i["metadata"]["name"] for i in items if i["kind"] == "Node"]
    pods = sum(1 for i in items if i["kind"] == "Pod")
    print(f"# scrape cost: {args.nodes} nodes x 8 GPUs, {pods} assigned pods, built in "
          f"{time.perf_counter() - started:.1f}s; {args.seconds:.0f} s per phase; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    port = 20000 + os.getpid() % 20000
    metrics_port = port + 1
    with tempfile.TemporaryDirectory() as tmp:
        snapshot = Path(tmp) / "snapshot.json"
        snapshot.write_bytes(orjson.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
        del items
        server = subprocess.Popen(
            [sys.executable, "-m", "kube_vgpu.cli", "extender", "--snapshot", str(snapshot), "--port", str(port),
             "--metrics-port", str(metrics_port), "--log-level", "WARNING", *args.extender_arg],
            cwd=ROOT,
        )
        try:
            wait_ready(metrics_port, server)
            for path, target in (("/metrics", metrics_port), ("/state", port)):
                fetch(target, path)  # warm: first-time imports and caches
                size, first_s, total_s, _ = fetch(target, path)
                print(f"GET {path:8s} alone: {size / 1e6:6.1f} MB, first byte {first_s * 1e3:7.0f} ms, "
                      f"whole reply {total_s * 1e3:7.0f} ms")
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            run_pods(connection, names, min(3.0, args.seconds))  # warm the per-shape caches
            collected: dict[str, dict[str, list[float]]] = {}
            cpu_by_phase: dict[str, list[float]] = {}  # label -> [extender user CPU s, system CPU s, wall s]
            polled_by: dict[str, list[tuple[int, float, float, float]]] = {}
            timeline: list[dict[str, Any]] = []
            # every other round in the reverse order (ABBA): the cluster fills as the run binds pods, so the verbs
            # slow down through the run, and a phase that always came second would take that drift as its own
            order = [phase for number in range(args.rounds)
                     for phase in (args.phases if number % 2 == 0 else args.phases[::-1])]
            for phase in order:
                stop = multiprocessing.Event()
                results: Any = multiprocessing.Queue()
                poller = None
                label = phase
                if phase.startswith("metrics"):
                    interval = args.scrape_interval_s if phase == "metrics-interval" else 0.0
                    label = f"metrics-every-{interval:g}s" if interval else phase
                    poller = multiprocessing.Process(target=poll, args=(metrics_port, "/metrics", interval, stop,
                                                                        results, args.poller_nice))
                elif phase == "state-interval":
                    label = f"state-every-{args.state_interval_s:g}s"
                    poller = multiprocessing.Process(target=poll, args=(port, "/state", args.state_interval_s, stop,
                                                                        results, args.poller_nice))
                elif phase == "dashboard":
                    label = "dashboard-page-open"
                    poller = multiprocessing.Process(target=dashboard_poll, args=(port, 2.0, stop, results))
                if poller is not None:
                    poller.start()
                cpu_before_s, wall_before_s = cpu_s(server.pid), time.monotonic()
                starts: dict[str, list[float]] = {"filter": [], "prioritize": []}
                timings = run_pods(connection, names, args.seconds, starts)
                answered: list[tuple[int, float, float, float]] = []
                if poller is not None:
                    stop.set()
                    answered = results.get(timeout=300)
                    polled_by.setdefault(label, []).extend(answered)
                    poller.join(60)
                timeline.append({"phase": label, "verbs": {verb: list(zip(starts[verb], timings[verb], strict=True))
                                                           for verb in timings},
                                 "requests": [(began, total_s, first_s) for _, first_s, total_s, began in answered]})
                used = cpu_by_phase.setdefault(label, [0.0, 0.0, 0.0])  # a render still running at the end counts too
                user_s, system_s = cpu_s(server.pid)
                used[0] += user_s - cpu_before_s[0]
                used[1] += system_s - cpu_before_s[1]
                used[2] += time.monotonic() - wall_before_s
                for verb, samples in timings.items():
                    collected.setdefault(label, {}).setdefault(verb, []).extend(samples)
                print(f"  {label}: {len(timings['filter'])} pods", flush=True)
            print(f"\n{'phase':22s}  pods  verb: p50 / p99 / max ms (p99 and p50 over the baseline's)")
            base = collected.get("baseline")
            for label, timings in collected.items():
                cells = []
                for verb in ("filter", "prioritize"):
                    p50, p99 = percentile(timings[verb], 50), percentile(timings[verb], 99)
                    ratio = ""
                    if base is not None:
                        ratio = (f" (p99 {p99 / percentile(base[verb], 99):4.2f}x, "
                                 f"p50 {p50 / percentile(base[verb], 50):4.2f}x)")
                    cells.append(f"{verb} {p50 * 1e3:5.2f} / {p99 * 1e3:6.2f} / {max(timings[verb]) * 1e3:6.1f}{ratio}")
                polled = ""
                if label in polled_by:
                    fetched = polled_by[label]
                    totals = [sample[2] for sample in fetched]
                    polled = (f"  [{len(fetched)} GETs of {fetched[-1][0] / 1e6:.1f} MB, p50 "
                              f"{percentile(totals, 50) * 1e3:.0f} ms, max {max(totals) * 1e3:.0f} ms]")
                user_s, system_s, wall_s = cpu_by_phase[label]
                cpu_used_s = user_s + system_s
                print(f"{label:22s} {len(timings['filter']):5d}  " + "  ".join(cells) + polled
                      + f"  [extender CPU {cpu_used_s:.1f} s (system {system_s:.1f}) in {wall_s:.0f} s, "
                        f"{cpu_used_s / len(timings['filter']) * 1e3:.1f} ms a pod]")
            print(f"extender RSS after the run: {rss_mib(server.pid):.0f} MiB")
            print_tails(timeline)
            if args.timeline:
                Path(args.timeline).write_bytes(orjson.dumps(timeline))
        finally:
            server.terminate()
            server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
