"""Enrolment: the machine's report (how its jobs are isolated, which limits hold) and the
enrollment a restarted agent resumes (the bootstrap token is single-use)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any

from catacloud.agent.client import Enrollment
from catacloud.agent.sandbox import Launcher, UidRange
from catacloud.protocol import Isolation, Limits, MachineReport

log = logging.getLogger("catacloud.agent")


def load_enrollment(state_file: str | None) -> Enrollment | None:
    """The enrollment a previous run of this agent saved (restart after a crash or reboot:
    the bootstrap token is single-use, so a restarted agent must not enroll again)."""
    if not state_file or not os.path.exists(state_file):
        return None
    try:
        with open(state_file) as fh:
            data = json.load(fh)
        enrollment = Enrollment.from_json(data)
    except (OSError, ValueError, KeyError, TypeError):
        log.warning("ignoring an unreadable state file %s", state_file)
        return None
    return enrollment


def save_enrollment(state_file: str | None, enrollment: Enrollment) -> None:
    if not state_file:
        return
    folder = os.path.dirname(os.path.abspath(state_file))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    fd = os.open(state_file + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(enrollment.to_json(), fh)
    os.replace(state_file + ".tmp", state_file)


def machine_report(
    launcher: Launcher,
    job_uids: UidRange | None,
    limits_file: str | None,
    images: dict[str, str] | None = None,
    disk: dict[str, Any] | None = None,
) -> MachineReport:
    """What this machine tells the control plane at enrollment: how jobs are isolated (and
    whether it runs images) and which resource limits hold (``disk``: how its jobs' disk is
    bounded)."""
    isolation = {**launcher.describe(), **(images or {})}
    isolation["job_uids"] = str(job_uids) if job_uids else "the agent's own, in a user namespace"
    if isolation["jobs"] == "uid" and job_uids is None:
        isolation["job_uids"] = "the agent's own"
    limits = {**read_limits(limits_file), **(disk or {})}
    if not limits.get("enforced", False):
        log.warning("resource limits are not enforced on this machine: %s", limits.get("detail", "unknown"))
    return MachineReport(isolation=Isolation.from_json(isolation), limits=Limits.from_json(limits))


def read_limits(path: str | None) -> dict[str, Any]:
    """The resource limits this machine runs under: what its host wrote to ``path`` (a local
    machine: cpus, memory, pids from its machine type, and whether a cgroup enforces them), else
    this machine's own size (a cloud machine: the provider enforces it)."""
    if path:
        try:
            with open(path) as fh:
                limits = json.load(fh)
            if isinstance(limits, dict):
                return limits
        except (OSError, ValueError) as exc:
            return {"enforced": False, "detail": f"cannot read {path}: {exc}"}
    memory_mb = None
    with contextlib.suppress(OSError, ValueError):
        memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    return {"enforced": True, "by": "machine", "cpus": os.cpu_count(), "memory_mb": memory_mb}
