"""Where this machine's jobs run: the work root (a folder per job, the ``catacloud`` wrapper
jobs call, the job socket's folder) and how a job starts there (a bubblewrap sandbox with its
network, or the uid-only supervisor), chosen once when the agent starts by trying them."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from catacloud.agent.netns import Egress, egress_problem, find_pasta, host_addresses, sweep
from catacloud.agent.sandbox import (
    BubblewrapLauncher,
    JobPlace,
    Launcher,
    UidLauncher,
    blocked_folder,
    bwrap_path,
    passable,
    probe,
    probe_network,
)

log = logging.getLogger("catacloud.agent")


@dataclass(frozen=True)
class JobSite:
    """The prepared work root: ``job_bin`` holds the ``catacloud`` wrapper, ``socket_dir`` the
    job socket."""

    work_root: str
    job_bin: str
    socket_dir: str


def prepare_site(work_root: str | None, sample_uid: int | None) -> JobSite | str:
    """Make the work root (a temporary one when none is given), or say why job uids cannot use it."""
    if work_root is None:
        work_root = tempfile.mkdtemp(prefix="catacloud-work-")
    else:
        os.makedirs(work_root, mode=0o700, exist_ok=True)
        sweep(work_root)  # what an agent killed here before left running
    if sample_uid is not None:
        # Jobs pass through (to their own 0700 folder, the socket) but cannot list the others.
        os.chmod(work_root, 0o711)
        blocked = blocked_folder(work_root, sample_uid)
        if blocked is not None:
            return (
                f"job uids cannot pass {blocked} on the way to the work folder {work_root}; "
                "choose another --work-dir (or --state-file folder)"
            )
    job_bin = write_job_bin(work_root)
    socket_dir = os.path.join(work_root, ".agent")
    os.makedirs(socket_dir, exist_ok=True)
    os.chmod(socket_dir, 0o711 if sample_uid is not None else 0o700)
    if not passable(sys.executable, sample_uid):
        log.warning(
            "jobs cannot run `catacloud` (job-meta, checkpoint): job uids cannot reach %s; "
            "install the agent in a folder every user can read",
            sys.executable,
        )
    return JobSite(work_root=work_root, job_bin=job_bin, socket_dir=socket_dir)


def choose_launcher(
    site: JobSite,
    *,
    sandbox: bool,
    network: bool,
    hostname: str,
    hidden: Sequence[str],
    shared: Sequence[str],
    sample_uid: int | None,
) -> Launcher:
    """A bubblewrap sandbox per job when one starts here (with the job network where this host
    can give one), else the uid-only supervisor. ``hidden``: the agent's own folders."""
    bwrap = bwrap_path() if sandbox else None
    if bwrap is None:
        if sandbox:
            log.warning("jobs run unsandboxed (their own uid only): bubblewrap (bwrap) is not installed")
        return UidLauncher()
    visible = {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix), site.job_bin}
    with contextlib.suppress(ImportError):
        import catacloud.agent

        visible.add(os.path.dirname(os.path.dirname(os.path.realpath(catacloud.agent.__file__))))
    launcher = BubblewrapLauncher(
        bwrap=bwrap,
        hostname=hostname,
        hidden=sorted({*hidden, site.work_root}),
        visible=sorted(p for p in visible if p),
        shared=shared,
    )
    folder = tempfile.mkdtemp(prefix=".probe-", dir=site.work_root)
    try:
        if sample_uid is not None:
            os.chown(folder, sample_uid, sample_uid)
        place = JobPlace(work_dir=folder, socket_path="", uid=sample_uid, gid=sample_uid)
        why = probe(launcher, place)
        if why is None:
            launcher.egress = choose_egress(launcher, place, network=network)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if why is not None:
        log.warning("jobs run unsandboxed (their own uid only): bubblewrap failed here: %s", why)
        return UidLauncher()
    return launcher


def choose_egress(launcher: BubblewrapLauncher, place: JobPlace, *, network: bool) -> Egress:
    """The internet through pasta when this host can (tried for real), else no network."""
    problem = egress_problem() if network else "turned off (--network none)"
    if problem is None:
        launcher.egress = Egress(
            "pasta",
            pasta=find_pasta() or "pasta",
            detail="the internet through pasta; loopback, private, link-local and this host refused",
            host_addresses=host_addresses(),
        )
        problem = probe_network(launcher, place)
    if problem is not None:
        log.warning("jobs get no network (a loopback only): %s", problem)
        return Egress("none", detail=f"no network: {problem}")
    return launcher.egress


def give(path: str, uid: int | None) -> None:
    """Make ``path`` (and what is under it) ``uid``'s, without following links; None: keep."""
    if uid is None:
        return
    os.lchown(path, uid, uid)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, uid)


def write_job_bin(work_root: str) -> str:
    """A ``bin`` folder for jobs' PATH holding ``catacloud``, a wrapper that runs this agent's
    Python (``catacloud job-meta``, ``catacloud checkpoint``). Jobs must find it even where no
    ``catacloud`` console script sits next to the Python (``python -m catacloud.agent``, a
    Python whose folder the job user cannot read). Owned by the agent; jobs may only run it."""
    bin_dir = os.path.join(work_root, "bin")
    os.makedirs(bin_dir, exist_ok=True)
    os.chmod(bin_dir, 0o755)
    path = os.path.join(bin_dir, "catacloud")
    with open(path + ".tmp", "w") as fh:
        fh.write(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m catacloud.agent "$@"\n')
    os.chmod(path + ".tmp", 0o755)
    os.replace(path + ".tmp", path)
    return bin_dir
