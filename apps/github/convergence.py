"""The reaper's rules for GitHub Actions (no GitHub call here: those run in the reconcile tasks
it sends). Each is a bounded query plus idempotent services.

- deliveries stored but never acted on (a crash between storing and acting): acted on;
- every runner class with queued jobs or unbound runners: converged (apps.github.demand);
- runner jobs assigned but not handed off for ``HANDOFF_REDRIVE`` seconds: the handoff sent
  again (a lost message or a killed worker);
- runners whose retirement was asked more than ``RETIRE_REDRIVE`` seconds ago: asked again;
- ended runner jobs' runner configurations: erased;
- installations due for a reconcile: one sent each.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from apps.core.broker import enqueue
from apps.github.demand import classes_converge, erase_ended_secrets
from apps.github.messages import HANDOFF_TASK, RETIRE_TASK
from apps.github.models import Runner
from apps.github.reconcile import reconciles_due
from apps.github.webhooks import deliveries_process
from apps.jobs.choices import JOB_LIVE, JobStatus

HANDOFF_REDRIVE = timedelta(seconds=20)
RETIRE_REDRIVE = timedelta(seconds=60)
BATCH = 200


def github_converge(*, now: datetime) -> dict[str, int]:
    report = {"github_deliveries_processed": deliveries_process()}
    report.update({f"github_runners_{k}": v for k, v in classes_converge().items()})
    handoffs = 0
    for job_id in Runner.objects.filter(
        job__status=JobStatus.ASSIGNED, job__status_changed_at__lt=now - HANDOFF_REDRIVE
    ).values_list("job_id", flat=True)[:BATCH]:
        handoffs += enqueue(HANDOFF_TASK, str(job_id))  # a handed-off job is left alone by the task
    retires = 0
    for job_id in Runner.objects.filter(
        retire_requested_at__lt=now - RETIRE_REDRIVE, job__status__in=JOB_LIVE, workflow_job__isnull=True
    ).values_list("job_id", flat=True)[:BATCH]:
        retires += enqueue(RETIRE_TASK, str(job_id))
    report["github_handoffs_redriven"] = handoffs
    report["github_retires_redriven"] = retires
    report["github_secrets_erased"] = erase_ended_secrets()
    report["github_reconciles_sent"] = reconciles_due(now=now)
    return report
