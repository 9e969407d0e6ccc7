"""Every hook of ``apps.core.hooks`` connected to its handler: the one place upward calls are wired."""

from __future__ import annotations

from typing import Any

from apps.core import hooks
from apps.core.broker import enqueue_on_commit
from apps.events.services import event_record
from apps.github.dispatch import runner_handoff_soon
from apps.jobs.acquisition import wake_waiting
from apps.jobs.agent import jobs_to_cancel
from apps.jobs.choices import JobStatus
from apps.jobs.models import Job
from apps.jobs.reports import jobs_requeue_for_instance
from apps.jobs.scheduler import schedule_grant_after_commit
from apps.jobs.tasks import schedule_task
from apps.pools.refill import request_refill


def _schedule_soon(instance: Any = None) -> None:
    """A machine became ready (or ended): a scheduling pass, and its grant's jobs placed in this
    request right after the commit (a job waiting for it need not wait for a worker)."""
    enqueue_on_commit(schedule_task)
    if instance is not None:
        schedule_grant_after_commit(org_id=instance.org_id, machine_type_id=instance.machine_type_id)


def _job_cost_keys(job_ids: Any) -> dict[str, dict[str, Any]]:
    rows = Job.objects.filter(pk__in=job_ids).values_list("pk", "config__name", "labels")
    return {
        str(pk): {"config": name, "repository": labels.get("repository"), "workflow": labels.get("workflow")}
        for pk, name, labels in rows
    }


def _jobs_waiting(*, org_id: Any, machine_type_id: Any) -> int:
    return Job.objects.filter(
        org_id=org_id, machine_type_id=machine_type_id, status=JobStatus.WAITING_FOR_MACHINE
    ).count()


def connect_hooks() -> None:
    hooks.record_event.connect(event_record)
    hooks.machine_available.connect(_schedule_soon)
    hooks.machine_gone.connect(jobs_requeue_for_instance)
    hooks.pool_member_left.connect(request_refill)
    hooks.resource_slot_freed.connect(wake_waiting)
    hooks.jobs_to_cancel.connect(jobs_to_cancel)
    hooks.job_cost_keys.connect(_job_cost_keys)
    hooks.jobs_waiting.connect(_jobs_waiting)
    hooks.job_needs_handoff.connect(runner_handoff_soon)
