"""The disk a job may fill: its machine type's ``disk_gb``, and a reserve the host keeps.

**The kernel's bound, where the machine's maker has root** (cloud machines, a root ``make dev``,
CI). A machine whose type sets ``disk_gb`` gets a *job area*: a file system of its own, of that
size, mounted on the agent's work root, which holds every job's work folder (the only place a
job may write that is not memory: its sandbox's ``/tmp``, ``/run`` and ``/dev/shm`` are tmpfs,
counted against the machine's memory). It is an ext4 file system in a sparse file, loop-mounted
(:func:`make_area`): made once per machine (a few milliseconds), never per job, and emptied
between jobs (the agent removes each job's folder; ``discard`` hands the freed blocks back to
the host's disk). A job that writes past it gets ``ENOSPC`` at once, inside the job, however it
writes (a single ``fallocate``, a file it unlinked and keeps open: the kernel counts every block);
the host's disk never lends it more than the area holds. The agent then ends the job with
``disk_limit_exceeded``.

Who makes the area: the local provider (its machines' agents run sandboxed without the right to
mount), and on a cloud machine the agent itself, which runs as root (``--disk-gb``). Where
neither can (no root, no loop device, no ``mkfs.ext4``), jobs run under the watchdog alone and
the machine reports why.

**The watchdog** (:class:`DiskWatch`) runs for every job. With an area it reads the area's use
(``statvfs``: one system call, whatever the job holds). Without one it adds up the job's work
folder and every deleted file the job's processes still hold open (``/proc/<pid>/fd``), and ends
the job once that is over the limit. What it cannot see, and only the area bounds: an allocation
is instant (``fallocate`` of all the free space lands between two checks), and a deleted file
kept alive only by a memory mapping or by a descriptor in flight in a unix socket is in no
process's file table.

**The host's reserve**: the agent ends a job that brings the free space of the host's disk (where
its work, or its area's file, lives) below the reserve, and starts none below it; the local
provider starts no machine below it (on a local machine that disk is the control plane's:
``$CATACLOUD_HOME``, PostgreSQL and Redis live there).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

INTERVAL_SECONDS = 0.25
CODE = "disk_limit_exceeded"
# An area holds its limit and ext4's own metadata (inode tables, bitmaps: about 3.5 % of a 1 GB
# file system without a journal, less of larger ones), so a job may write all of its disk_gb.
AREA_OVERHEAD_FRACTION = 0.04
AREA_OVERHEAD_BYTES = 32 * 2**20
# Tools made for it: e2fsprogs' mkfs.ext4 and util-linux's mount and umount (both essential on
# Debian and Ubuntu, on every cloud image); the system folders, whatever the caller's PATH.
TOOL_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# No journal: an area holds nothing that must survive a crash (a crashed machine's area is made
# anew). Inode tables are left to be zeroed lazily and never are (noinit_itable): a sparse file's
# holes read as zeros already, so a new area costs the host's disk a few hundred KB.
MKFS_ARGS = ("-q", "-F", "-m", "0", "-O", "^has_journal", "-E", "lazy_itable_init=1,nodiscard")
# nosuid, nodev: nothing a job leaves in its folder carries a privilege; discard: blocks a job
# frees (its folder removed) go back to the host's disk.
MOUNT_OPTIONS = "loop,nosuid,nodev,discard,noinit_itable"
CAP_SYS_ADMIN = 21  # linux/capability.h
# The mark make_area leaves at an area's root: only a folder carrying it is taken for an area.
AREA_MARK = ".catacloud-job-area"


def area_file_size(limit_bytes: int) -> int:
    """The size of the file holding an area whose jobs may write ``limit_bytes``."""
    return limit_bytes + int(limit_bytes * AREA_OVERHEAD_FRACTION) + AREA_OVERHEAD_BYTES


@dataclass(frozen=True)
class Area:
    """A file system of fixed size whose root is ``folder``."""

    folder: str
    size_bytes: int  # what it holds for files

    def used_bytes(self) -> int:
        st = os.statvfs(self.folder)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def describe(self) -> str:
        return f"a file system of its own ({_gb(self.size_bytes)}) at {self.folder}"


def find_area(folder: str) -> Area | None:
    """The job area mounted on ``folder`` (a mount point that :func:`make_area` marked), else
    ``None``: a file system that merely is mounted there (an operator's partition, a tmpfs) is
    never taken for one, nor emptied."""
    try:
        if not os.path.ismount(folder) or not os.path.isfile(os.path.join(folder, AREA_MARK)):
            return None
        st = os.statvfs(folder)
    except OSError:
        return None
    return Area(folder, st.f_blocks * st.f_frsize)


def make_area(folder: str, image: str, limit_bytes: int) -> Area | str:
    """A job area at ``folder`` for jobs of ``limit_bytes``: an ext4 file system in the sparse
    file ``image``, loop-mounted. Needs root (``CAP_SYS_ADMIN``). Idempotent: a folder that is a
    mount point already is that area. The area, or why there is none (nothing is left behind)."""
    found = find_area(folder)
    if found is not None:
        return found
    mkfs = shutil.which("mkfs.ext4", path=TOOL_PATH)
    mount = shutil.which("mount", path=TOOL_PATH)
    if mkfs is None or mount is None:
        return "mkfs.ext4 (e2fsprogs) or mount (util-linux) is not installed"
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(image)  # a crashed machine's: its successor starts empty
        fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, area_file_size(limit_bytes))
        finally:
            os.close(fd)
        _tool([mkfs, *MKFS_ARGS, image])
        _tool([mount, "-t", "ext4", "-o", MOUNT_OPTIONS, image, folder])
    except (OSError, subprocess.SubprocessError) as exc:
        release_area(folder, image)
        return f"cannot make a file system of {_gb(limit_bytes)} for jobs: {_reason(exc)}"
    with contextlib.suppress(OSError):
        os.rmdir(os.path.join(folder, "lost+found"))  # fsck's, not a job's
    try:
        with open(os.path.join(folder, AREA_MARK), "x") as fh:
            fh.write(f"a job area of {limit_bytes} bytes (catacloud/agent/disk.py)\n")
    except OSError as exc:
        release_area(folder, image)
        return f"cannot mark the file system made for jobs: {_reason(exc)}"
    area = find_area(folder)
    return area if area is not None else f"{folder} is not a mount point after mounting it"


def can_mount() -> bool:
    """Whether this process may mount (``CAP_SYS_ADMIN`` among its effective capabilities)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def job_area(
    work_root: str | None, limit_bytes: int | None, *, why_not: str = ""
) -> tuple[Area | None, dict[str, Any]]:
    """The machine's job area: the one its maker mounted on ``work_root``, else one made now
    where this process may mount (a cloud machine's agent); with what the machine reports of
    its disk (``why_not``: what its maker said when it could not make one)."""
    area = find_area(work_root) if work_root else None
    if work_root is None:
        why_not = why_not or "no work folder was given (--work-dir)"
    elif area is None and limit_bytes and can_mount():
        made = make_area(work_root, work_root.rstrip("/") + ".img", limit_bytes)
        if isinstance(made, str):
            why_not = made
        else:
            area = made
    if area is not None:
        empty_area(area)
        return area, {
            "disk": "file system",
            "disk_bytes": area.size_bytes,
            "disk_detail": f"bounded by the kernel: jobs write to {area.describe()}",
        }
    if not limit_bytes:
        detail = "no disk_gb: the watchdog keeps the host's reserve"
    else:
        why_not = why_not or "making a file system for jobs needs root (CAP_SYS_ADMIN)"
        detail = f"the watchdog alone ({why_not}): an instant allocation can pass the limit before a check"
    return None, {"disk": "watchdog", "disk_bytes": None, "disk_detail": detail}


def empty_area(area: Area) -> None:
    """Remove what an earlier run of the agent left in its area (a restarted agent: its jobs
    ended with it), so the next job finds the whole area free."""
    with os.scandir(area.folder) as entries:
        for entry in list(entries):
            if entry.name == AREA_MARK:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def release_area(folder: str, image: str | None = None) -> None:
    """Unmount ``folder``'s area (lazily: a machine's processes that still hold it keep it until
    they end; the loop device goes with its last user) and remove its file. Idempotent."""
    umount = shutil.which("umount", path=TOOL_PATH)
    for point in sorted(mounts_under(folder), key=len, reverse=True):
        if umount is not None:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                _tool([umount, "-l", point])
    if image is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(image)


def mounts_under(folder: str) -> list[str]:
    """Mount points at or under ``folder`` in this process's mount namespace."""
    base = os.path.abspath(folder).rstrip("/") or "/"
    found = []
    try:
        with open("/proc/self/mountinfo") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if len(fields) < 5:
            continue
        point = _unescape(fields[4])
        if point == base or point.startswith(base + "/"):
            found.append(point)
    return found


def _unescape(path: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        path = path.replace(code, char)
    return path


def _tool(argv: list[str]) -> None:
    subprocess.run(
        argv,
        check=True,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
        env={"PATH": TOOL_PATH, "LANG": "C.UTF-8"},
    )


def _reason(exc: BaseException) -> str:
    if isinstance(exc, subprocess.CalledProcessError):
        said = (exc.stderr or b"").decode(errors="replace").strip().splitlines()
        return f"{os.path.basename(str(exc.cmd[0]))}: {said[-1] if said else f'exit code {exc.returncode}'}"
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)


def usage(folder: str, seen: set[tuple[int, int]] | None = None) -> int:
    """Bytes the files under ``folder`` occupy (allocated blocks, each inode once, links not
    followed); the inodes counted are added to ``seen``."""
    seen = set() if seen is None else seen
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


def held_deleted(pids: Iterable[int], device: int, seen: set[tuple[int, int]]) -> int:
    """Bytes of the deleted files on ``device`` that the processes ``pids`` hold open (each inode
    once, none of ``seen``): what a job keeps on the disk after unlinking it."""
    total = 0
    for pid in pids:
        try:
            entries = os.scandir(f"/proc/{pid}/fd")
        except OSError:
            continue  # gone, or not ours to read
        with entries:
            for entry in entries:
                try:
                    st = os.stat(entry.path)  # the open file itself, deleted or not
                except OSError:
                    continue
                key = (st.st_dev, st.st_ino)
                if st.st_dev != device or st.st_nlink or not stat.S_ISREG(st.st_mode) or key in seen:
                    continue
                seen.add(key)
                total += st.st_blocks * 512
    return total


def free_bytes(folder: str) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def _gb(value: int) -> str:
    return f"{value / 10**9:.1f} GB"


@dataclass
class DiskWatch:
    """Called by the job's supervisor loop; answers why the job must end, or ``None``."""

    folder: str  # the job's work folder
    limit_bytes: int | None  # the machine type's disk_gb; None: no limit of its own
    reserve_bytes: int = 0  # free space the host's disk keeps whatever the job does
    area: Area | None = None  # the work root's own file system, when it has one
    host_folder: str = ""  # a folder on the host's disk (the area's file lives there); "": folder
    baseline_bytes: int = 0  # what the area held before the job (the agent's own few files)
    interval: float = INTERVAL_SECONDS
    # The job's processes (their pids), once it runs: the watchdog counts what they hold open.
    processes: Callable[[], Iterable[int]] | None = None
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

    def follow(self, pids: Callable[[], Iterable[int]]) -> None:
        self.processes = pids

    def check(self) -> str | None:
        if self.reserve_bytes:
            try:
                free = free_bytes(self.host_folder or self.folder)
            except OSError:
                free = self.reserve_bytes
            if free < self.reserve_bytes:
                return (
                    f"{CODE}: the machine's disk has {_gb(free)} free, below the {_gb(self.reserve_bytes)} "
                    "its host keeps"
                )
        if self.area is not None:
            return self._check_area(self.area)
        if self.limit_bytes:
            used = self.job_bytes()
            if used > self.limit_bytes:
                return (
                    f"{CODE}: the job's files reached {_gb(used)}, over its machine type's disk_gb "
                    f"({_gb(self.limit_bytes)})"
                )
        return None

    def _check_area(self, area: Area) -> str | None:
        try:
            st = os.statvfs(area.folder)
        except OSError:
            return None
        used = (st.f_blocks - st.f_bfree) * st.f_frsize - self.baseline_bytes
        if self.limit_bytes and used > self.limit_bytes:
            return (
                f"{CODE}: the job's files reached {_gb(used)}, over its machine type's disk_gb "
                f"({_gb(self.limit_bytes)}); its file system refuses more"
            )
        if st.f_bavail * st.f_frsize < AREA_OVERHEAD_BYTES // 8:
            return f"{CODE}: the job filled its disk ({_gb(area.size_bytes)}, its machine type's disk_gb)"
        return None

    def job_bytes(self) -> int:
        """Without an area: the job's folder, and the deleted files its processes hold open."""
        seen: set[tuple[int, int]] = set()
        total = usage(self.folder, seen)
        if self.processes is not None:
            try:
                device = os.stat(self.folder).st_dev
            except OSError:
                return total
            total += held_deleted(self.processes(), device, seen)
        return total
