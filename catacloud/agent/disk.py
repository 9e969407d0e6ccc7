"""The disk a job may fill: its machine type's ``disk_gb``, and a reserve the host keeps.

A job writes into its work folder (and its sandbox's ``/tmp``, which is memory and counts
against the machine's memory limit). A watchdog measures the work folder while the job runs
and ends the job with ``disk_limit_exceeded`` once it holds more than the limit, or once the
file system it lives on has less free space than the reserve (on a local machine that file
system is the control plane's: ``$CATACLOUD_HOME``, PostgreSQL and Redis live there). The
agent removes the work folder after every job, so the next job starts with the disk empty.

Why a watchdog and not a file system of a fixed size: it needs no root, no loop device and no
quota-enabled mount, so it holds the same way on a laptop's ``make dev``, a CI runner and a cloud
machine. What it costs: a job writing as fast as the disk allows can overshoot the limit by
what it writes between two checks (every :data:`INTERVAL_SECONDS`, longer for a folder that
takes long to walk), which is why the reserve is kept well above that.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field

INTERVAL_SECONDS = 0.25
CODE = "disk_limit_exceeded"


def usage(folder: str) -> int:
    """Bytes the files under ``folder`` occupy (allocated blocks, each inode once, links not
    followed)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = [folder]
    while stack:
        current = stack.pop()
        try:
            entries = os.scandir(current)
        except OSError:
            continue
        with entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    continue
                seen.add(key)
                total += st.st_blocks * 512
                if stat.S_ISDIR(st.st_mode):
                    stack.append(entry.path)
    return total


def free_bytes(folder: str) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def _gb(value: int) -> str:
    return f"{value / 10**9:.1f} GB"


@dataclass
class DiskWatch:
    """Called by the job's supervisor loop; answers why the job must end, or ``None``."""

    folder: str
    limit_bytes: int | None  # the machine type's disk_gb; None: no limit of its own
    reserve_bytes: int = 0  # free space the file system keeps whatever the job does
    interval: float = INTERVAL_SECONDS
    _next: float = field(default=0.0, init=False)

    def __call__(self, *, force: bool = False) -> str | None:
        """Checked at most every ``interval`` unless ``force`` (once the job has ended: a job
        that wrote its files between two checks is caught too)."""
        now = time.monotonic()
        if now < self._next and not force:
            return None
        why = self.check()
        took = time.monotonic() - now
        self._next = time.monotonic() + max(self.interval, 4 * took)  # a huge tree: check less often
        return why

    def check(self) -> str | None:
        if self.reserve_bytes:
            try:
                free = free_bytes(self.folder)
            except OSError:
                free = self.reserve_bytes
            if free < self.reserve_bytes:
                return (
                    f"{CODE}: the machine's disk has {_gb(free)} free, below the {_gb(self.reserve_bytes)} "
                    "its host keeps"
                )
        if self.limit_bytes:
            used = usage(self.folder)
            if used > self.limit_bytes:
                return (
                    f"{CODE}: the job's files reached {_gb(used)}, over its machine type's disk_gb "
                    f"({_gb(self.limit_bytes)})"
                )
        return None
