"""One scheduling pass: admission (apps.jobs.admission), then placement (apps.jobs.placement).
Triggered after commit by a submit, a job's end, a machine becoming ready or a quota change;
the reaper runs it as a safety net. Any number may run at once on any number of workers.

A submit does :func:`schedule_grant_here` in its own transaction: the same two steps for the
submitted job's grant only, so a job that fits goes to a warm machine in the submit's own commit,
without waiting for a worker to pick up a pass (one is enqueued only when the grant was held by
another transaction, or the step failed). So do, right after their commit
(:func:`schedule_grant_after_commit`), a job's end that hands its machine back for reuse and a
machine becoming ready: a paid machine goes to the job waiting for it at once, before that job
waits long enough for the cost policy to buy."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.conf import settings
from django.db import OperationalError, transaction

from apps.core.ids import MachineTypeId, OrgId
from apps.jobs.admission import admit, admit_grant
from apps.jobs.choices import JobStatus
from apps.jobs.dispatch import schedule_after_commit
from apps.jobs.models import Job
from apps.jobs.placement import place
from apps.machines.services import grant_lock

log = logging.getLogger(__name__)


@dataclass
class ScheduleReport:
    admitted: int = 0
    assigned: int = 0
    provisioned: int = 0
    waiting: int = 0


def schedule(*, limit: int = 500) -> ScheduleReport:
    report = ScheduleReport()
    report.admitted = admit(limit=limit)
    assigned, provisioned, waiting = place(limit=limit)
    report.assigned, report.provisioned, report.waiting = assigned, provisioned, waiting
    return report


def schedule_grant_now(
    *, org_id: OrgId, machine_type_id: MachineTypeId, if_waiting: bool = False
) -> int | None:
    """Admit and place the queued jobs of one grant now, in queue order, if nobody else is
    doing it: a grant another transaction holds (a scheduling pass, a refill, another submit)
    is left to the pass already enqueued instead of waited for, and so is any failure (the job
    is committed and queued; the pass and the reaper find it). Returns how many were assigned,
    or None when it did not run (the grant held, or a failure).
    One transaction for both steps (the grant locked once, one commit; a savepoint of the
    caller's when called inside one): a job admitted here is on its machine when anyone else
    sees it admitted, and a failure leaves it queued. ``if_waiting``: only when a job of the grant
    is queued or waits for a machine (one indexed statement, where this is a lock, admission and
    placement); after a commit, where nothing of a failure may reach the caller."""
    try:
        if if_waiting and not _grant_waits(org_id, machine_type_id):
            return 0
        with transaction.atomic():
            locked = grant_lock(org_id=org_id, machine_type_id=machine_type_id, nowait=True, with_type=True)
            if locked is None:  # no longer granted: the pass says so on the jobs
                return None
            admit_grant(org_id=org_id, machine_type_id=machine_type_id, limit=FAST_PATH_LIMIT, locked=locked)
            assigned, _, _ = place(limit=FAST_PATH_LIMIT, grant=(org_id, machine_type_id), locked=locked)
        return assigned
    except OperationalError:  # the grant is held right now: the enqueued pass will do it
        return None
    except Exception:
        log.exception("scheduling a submitted job at once failed; the scheduling pass will")
        return None


def schedule_grant_here(*, org_id: OrgId, machine_type_id: MachineTypeId) -> bool:
    """:func:`schedule_grant_now` inside the caller's transaction, as a savepoint (a submit: the
    job is admitted and on its machine in the submit's own commit, and its agent woken by it),
    when ``CATACLOUD_SCHEDULE_ON_SUBMIT`` is on. True when it ran: the grant's scheduling pass
    is done and none need be enqueued for it; False: the caller enqueues one."""
    if not settings.CATACLOUD_SCHEDULE_ON_SUBMIT:
        return False
    return schedule_grant_now(org_id=org_id, machine_type_id=machine_type_id) is not None


def schedule_grant_after_commit(*, org_id: OrgId, machine_type_id: MachineTypeId) -> None:
    """:func:`schedule_grant_now` right after the current transaction commits, when a job of the
    grant waits then (when ``CATACLOUD_SCHEDULE_ON_SUBMIT`` is on; the enqueued scheduling pass
    does it otherwise). A job whose commit this does not see yet is the enqueued pass's: every
    caller enqueues one too (:func:`schedule_for_machine`, a job's end)."""
    if settings.CATACLOUD_SCHEDULE_ON_SUBMIT:
        transaction.on_commit(
            lambda: schedule_grant_now(org_id=org_id, machine_type_id=machine_type_id, if_waiting=True)
        )


def _grant_waits(org_id: OrgId, machine_type_id: MachineTypeId) -> bool:
    waiting = (JobStatus.QUEUED, JobStatus.WAITING_FOR_MACHINE)
    return Job.objects.filter(org_id=org_id, machine_type_id=machine_type_id, status__in=waiting).exists()


def schedule_for_machine(*, org_id: OrgId, machine_type_id: MachineTypeId) -> None:
    """A machine of this grant became ready or ended (``hooks.machine_available``): a scheduling
    pass after commit, and the grant's jobs placed in this request right after the commit (a
    job waiting for the machine need not wait for a worker)."""
    schedule_after_commit()
    schedule_grant_after_commit(org_id=org_id, machine_type_id=machine_type_id)


# How many of a grant's jobs the fast path takes at once (a submit brings one; a few more that
# were queued behind a full quota may fit by now).
FAST_PATH_LIMIT = 8
