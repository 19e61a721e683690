"""The pods filter saw, kept for bind: kube-scheduler's bind request names a pod (namespace, name, UID) but does not
carry it, and reading it from the API server would put a round trip on every bind.

Each pod is kept as its JSON bytes, not as the parsed dicts: a pod's dicts and strings take ~4-5x the memory of its
JSON (a 1 KB pod ~4.6 KB parsed), and a busy cluster's extender keeps every pod it filtered in the last ten minutes
(up to `MAX_PODS`). Bind decodes its pod again (~5 us for 1 KB): each read is a fresh object, which callers may
change freely. `metadata.managedFields` (the API server's record of which client wrote which field) is left out:
nothing in the extender reads it, and it is often the largest part of a pod.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson
from cachetools import TTLCache

#: pods kept at most (the oldest go first), and for how long after their last filter
MAX_PODS = 50_000
TTL_S = 600.0


def encode_pod(pod: Mapping[str, Any]) -> bytes | Mapping[str, Any]:
    """The pod as kept: its JSON without managedFields, or the pod itself where it is no JSON document (an in-process
    caller's objects: kept as given, so bind reads exactly what filter saw)."""
    metadata = pod.get("metadata")
    if isinstance(metadata, Mapping) and "managedFields" in metadata:
        pod = {**pod, "metadata": {key: value for key, value in metadata.items() if key != "managedFields"}}
    try:
        # copied to its exact size: orjson's bytes keep the buffer it grew (4 KB for a 1 KB pod)
        return bytes(memoryview(orjson.dumps(pod)))
    except TypeError:  # orjson.JSONEncodeError: a value JSON has no form for
        return pod


class RecentPods:
    """uid -> the pod as filter last saw it, for `TTL_S` after that filter. Thread-safe (the TTL cache expires
    entries on reads too, so every access takes the lock)."""

    def __init__(self, max_pods: int = MAX_PODS, ttl_s: float = TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pods: TTLCache[str, bytes | Mapping[str, Any]] = TTLCache(maxsize=max_pods, ttl=ttl_s, timer=clock)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._pods)

    def __contains__(self, uid: object) -> bool:
        with self._lock:
            return uid in self._pods

    def remember(self, uid: str, pod: Mapping[str, Any]) -> bool:
        """Keep this pod (its TTL starts again); True if it was not kept before (filter's first sight of it)."""
        kept = encode_pod(pod)  # outside the lock: the encoding is the only cost
        with self._lock:
            first = uid not in self._pods
            self._pods[uid] = kept
        return first

    def get(self, uid: str) -> Mapping[str, Any] | None:
        """The pod as filter last saw it (a fresh object, unless it was kept as given); None if not seen within the
        TTL."""
        with self._lock:
            kept = self._pods.get(uid)
        if isinstance(kept, bytes):
            decoded: Mapping[str, Any] = orjson.loads(kept)
            return decoded
        return kept
