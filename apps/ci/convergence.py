"""The reaper's rules for every forge (no forge call here: those run in the tasks it sends).
Each is a bounded query plus idempotent services.

- deliveries stored but never acted on (a crash between storing and acting): acted on;
- every runner class with pending jobs or unbound runners: converged (apps.ci.demand);
- runner jobs assigned but not handed off for ``HANDOFF_REDRIVE`` seconds: the handoff sent
  again (a lost message or a killed worker);
- runners whose retirement was asked more than ``RETIRE_REDRIVE`` seconds ago: asked again;
- runner jobs held by a limit (``held_until``: our pacing below a documented limit, a runner
  cap) whose wait is over: released, so admission takes them again (a release is also sent for
  the wait's end when they are held: this rule catches one that was lost);
- ended runner jobs' runner secrets: erased;
- endpoints due for a reconcile: one sent each.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from apps.ci.availability import held_release
from apps.ci.demand import classes_converge, erase_ended_secrets
from apps.ci.forge import Forge, forges
from apps.ci.intake import deliveries_process
from apps.ci.reconcile import reconciles_due
from apps.core.broker import enqueue
from apps.jobs.choices import JOB_LIVE, JobStatus

HANDOFF_REDRIVE = timedelta(seconds=20)
RETIRE_REDRIVE = timedelta(seconds=60)
BATCH = 200


def forge_converge(*, forge: Forge, now: datetime) -> dict[str, int]:
    """One forge's rules; the report's keys carry the forge's name (``github_…``)."""
    name = forge.name
    report = {f"{name}_deliveries_processed": deliveries_process(forge=forge)}
    report[f"{name}_held_released"] = held_release(forge=forge, now=now)
    report.update({f"{name}_runners_{k}": v for k, v in classes_converge(forge=forge).items()})
    handoffs = 0
    for job_id in forge.runner.objects.filter(
        job__status=JobStatus.ASSIGNED, job__status_changed_at__lt=now - HANDOFF_REDRIVE
    ).values_list("job_id", flat=True)[:BATCH]:
        handoffs += enqueue(forge.tasks.handoff, str(job_id))  # a handed-off job is left alone by the task
    retires = 0
    for job_id in forge.runner.objects.filter(
        retire_requested_at__lt=now - RETIRE_REDRIVE, job__status__in=JOB_LIVE, **forge.unbound()
    ).values_list("job_id", flat=True)[:BATCH]:
        retires += enqueue(forge.tasks.retire, str(job_id))
    report[f"{name}_handoffs_redriven"] = handoffs
    report[f"{name}_retires_redriven"] = retires
    report[f"{name}_secrets_erased"] = erase_ended_secrets(forge=forge)
    report[f"{name}_reconciles_sent"] = reconciles_due(forge=forge, now=now)
    return report


def ci_converge(*, now: datetime) -> dict[str, int]:
    """Every registered forge's rules (the reaper's tick)."""
    report: dict[str, int] = {}
    for forge in forges():
        report.update(forge_converge(forge=forge, now=now))
    return report
