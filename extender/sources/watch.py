"""List and watch through the kubernetes client, as raw JSON (orjson): the machinery every watching part of the
extender shares (the cluster source, extender/sources/live.py; the Kueue watcher, extender/quota/live.py).

Objects are read as raw JSON instead of the client's generated models: at tens of thousands of pods the model
deserialisation would dominate start-up and event handling.

A watch can die silently: a connection whose far end is gone without a FIN or RST (a NAT or load-balancer entry
dropped, a network path cut) delivers nothing and reports nothing. Every watch therefore asks for bookmarks
(`allowWatchBookmarks`: the API server sends one about once a minute) and is ended by the API server after
`watch_server_timeout_s`, so a live watch is never silent for `watch_progress_s`; the stream's socket read timeout
is that progress timeout, and a watch that trips it raises WatchStalled and is opened again by its caller.
`WatchHealth` records each watch's progress for /readyz and /metrics.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import urllib3

from kube_vgpu.extender.sources.apiclient import DEFAULT_TIMEOUTS, ApiTimeouts, read_body

#: objects per list page
LIST_PAGE_SIZE = 500

ListCall = Callable[..., Any]


class Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410): relist."""


class WatchStalled(Exception):
    """The watch delivered nothing (no event, no bookmark, no end) for its progress timeout."""


class ListPager:
    """The pages of a list call, each a list of objects read under its own deadline, one at a time as they are
    iterated; `resource_version` is the list's (to watch from) once the last page was read."""

    def __init__(self, list_call: ListCall, *, timeouts: ApiTimeouts = DEFAULT_TIMEOUTS) -> None:
        self.list_call = list_call
        self.timeouts = timeouts
        self.resource_version = ""

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        token = None
        while True:
            deadline = time.monotonic() + self.timeouts.list_page_s
            kwargs: dict[str, Any] = {
                "limit": LIST_PAGE_SIZE,
                "_preload_content": False,
                "_request_timeout": self.timeouts.list_page_s,  # connect and headers; the body: read_body
            }
            if token:
                kwargs["_continue"] = token
            response = self.list_call(**kwargs)
            doc = orjson.loads(read_body(response, deadline, "list"))
            if not isinstance(doc, dict):
                raise ValueError("the API server answered a list with something other than a JSON object")
            metadata = doc.get("metadata") or {}
            token = metadata.get("continue")
            page = [item for item in doc.get("items") or [] if isinstance(item, dict)]
            del doc
            yield page
            if not token:
                self.resource_version = str(metadata.get("resourceVersion") or "")
                return


def list_all(
    list_call: ListCall, *, timeouts: ApiTimeouts = DEFAULT_TIMEOUTS
) -> tuple[list[dict[str, Any]], str]:
    """Every object of a list call, page by page (each page under its own deadline), and the list's
    resourceVersion to watch from."""
    pager = ListPager(list_call, timeouts=timeouts)
    items = [item for page in pager for item in page]
    return items, pager.resource_version


def watch_events(
    list_call: ListCall,
    resource_version: str,
    stop: threading.Event,
    *,
    timeouts: ApiTimeouts = DEFAULT_TIMEOUTS,
    on_progress: Callable[[], None] | None = None,
    on_open: Callable[[Any], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """The events of one watch from `resource_version` (bookmarks included), until the API server ends it.
    Raises WatchStalled when nothing arrives for `timeouts.watch_progress_s`; `on_progress` is called when the
    watch is open and whenever bytes arrive; `on_open` gets the open response (closing it ends the watch)."""
    try:
        response = list_call(
            watch=True,
            resource_version=resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeouts.watch_server_timeout_s,
            _preload_content=False,
            # the read timeout applies to every read of the stream: it is the progress watchdog
            _request_timeout=(timeouts.connect_s, timeouts.watch_progress_s),
        )
    except urllib3.exceptions.ReadTimeoutError:
        raise WatchStalled(f"the watch was not answered within {timeouts.watch_progress_s:g} s") from None
    if on_open is not None:
        on_open(response)
    if on_progress is not None:
        on_progress()
    buffer = b""
    try:
        try:
            for chunk in response.stream(amt=None, decode_content=True):
                if stop.is_set():
                    return
                if on_progress is not None:
                    on_progress()
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        event = orjson.loads(line)
                        if isinstance(event, dict):
                            yield event
        except urllib3.exceptions.ReadTimeoutError:
            raise WatchStalled(f"no event or bookmark for {timeouts.watch_progress_s:g} s") from None
    finally:
        response.close()  # a watch connection is never reused: a stalled one may be dead


@dataclass
class WatchHealth:
    """How one watch is doing, for /readyz and /metrics. Thread-safe enough: one writer (the watch's thread);
    readers take a consistent-enough snapshot of plain attributes."""

    resource: str
    #: a watch without progress for this long is reported dead (the watchdog closes it at the same moment)
    stall_after_s: float
    clock: Callable[[], float] = time.monotonic
    #: the last time the watch (or its list) made progress; None before the first list
    last_progress_s: float | None = None
    #: restarts by reason: "stalled", "expired" (410), "error"
    restarts: dict[str, int] = field(default_factory=dict)
    last_error: str = ""

    def progressed(self) -> None:
        self.last_progress_s = self.clock()

    def restarted(self, reason: str, error: str = "") -> None:
        self.restarts[reason] = self.restarts.get(reason, 0) + 1
        if error:
            self.last_error = error

    def silent_for_s(self, now: float | None = None) -> float | None:
        if self.last_progress_s is None:
            return None
        return (self.clock() if now is None else now) - self.last_progress_s

    def problem(self, now: float | None = None) -> str | None:
        """Why this watch is not healthy, or None."""
        silent = self.silent_for_s(now)
        if silent is None or silent < self.stall_after_s:
            return None  # before the first list, readiness waits for the initial sync instead
        detail = f"; last error: {self.last_error}" if self.last_error else ""
        return f"the {self.resource} watch has delivered nothing for {silent:.0f} s{detail}"
