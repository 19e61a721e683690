"""Starting and stopping the dev cluster's processes, and recognising them again later by PID.

A PID alone is not an identity: after a reboot or a long time the number may belong to another process. Each
record therefore keeps the process's start time (field 22 of /proc/PID/stat, clock ticks since boot); a PID whose
start time differs is not ours and is never signalled.

Every process is started in its own session (setsid): `dev-cluster up` returns while they keep running, a Ctrl-C
in the shell that ran `up` does not reach them, and stopping one signals its whole process group.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

STOP_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1

# All spawns go through one long-lived thread: PR_SET_PDEATHSIG fires when the *thread* that forked the child
# exits, so a child started from a short-lived helper thread would be killed when that thread ends.
_spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="devcluster-spawner")


@dataclass(frozen=True)
class ProcessRecord:
    name: str
    pid: int
    start_ticks: int
    argv: tuple[str, ...]
    log: str

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["argv"] = list(self.argv)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProcessRecord:
        return cls(
            name=str(data["name"]),
            pid=int(data["pid"]),
            start_ticks=int(data["start_ticks"]),
            argv=tuple(str(arg) for arg in data["argv"]),
            log=str(data["log"]),
        )


def process_start_ticks(pid: int) -> int | None:
    """Start time of a live (non-zombie) process, or None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may contain spaces and parentheses: split after the last ')'
    fields = text[text.rindex(")") + 2 :].split()
    state = fields[0]
    if state in ("Z", "X"):
        return None
    return int(fields[19])


def is_running(record: ProcessRecord) -> bool:
    return process_start_ticks(record.pid) == record.start_ticks


def _die_with_parent() -> None:
    """preexec_fn: the kernel kills the child when the thread that started it exits (tests, demo)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def spawn(
    name: str,
    argv: Sequence[str],
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    die_with_parent: bool = False,
) -> tuple[ProcessRecord, subprocess.Popen[bytes]]:
    """Start `argv` in a new session with stdout and stderr appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)

    def start() -> subprocess.Popen[bytes]:
        with open(log_path, "ab") as log_file:
            log_file.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {' '.join(argv)}\n".encode())
            log_file.flush()
            return subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent if die_with_parent else None,
            )

    process = _spawner.submit(start).result()
    ticks = process_start_ticks(process.pid)
    if ticks is None:  # died at once (exec failed after fork, or crashed): still record it, the caller reports
        process.poll()
        ticks = -1
    return ProcessRecord(name, process.pid, ticks, tuple(argv), str(log_path)), process


def stop(record: ProcessRecord, process: subprocess.Popen[bytes] | None = None, grace_s: float = STOP_GRACE_S) -> bool:
    """SIGTERM the process group, SIGKILL after `grace_s`. Returns False when it was not running (nothing sent)."""
    if not is_running(record):
        if process is not None:
            process.poll()  # reap a zombie child
        return False
    _signal_group(record, signal.SIGTERM)
    if not _wait_gone(record, process, grace_s):
        _signal_group(record, signal.SIGKILL)
        _wait_gone(record, process, grace_s)
    return True


def kill(record: ProcessRecord, process: subprocess.Popen[bytes] | None = None) -> bool:
    """SIGKILL at once (crash simulation)."""
    if not is_running(record):
        return False
    _signal_group(record, signal.SIGKILL)
    _wait_gone(record, process, STOP_GRACE_S)
    return True


def _signal_group(record: ProcessRecord, signum: int) -> None:
    # The process leads its own group (setsid at spawn), so the group id is its PID; checked again just before
    # signalling so that a PID reused in between is left alone.
    if not is_running(record):
        return
    try:
        if os.getpgid(record.pid) == record.pid:
            os.killpg(record.pid, signum)
        else:
            os.kill(record.pid, signum)
    except ProcessLookupError:
        pass


def _wait_gone(record: ProcessRecord, process: subprocess.Popen[bytes] | None, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0.05)
        if not is_running(record):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def log_tail(path: str | Path, lines: int = 25) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 64 * 1024))
            text = handle.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])

