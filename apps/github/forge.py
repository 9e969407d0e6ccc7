"""GitHub, as the CI core (apps.ci) sees it: its tables, statuses, events, tasks and settings.
What it does at GitHub is :class:`apps.github.ops.GitHubOps`."""

from __future__ import annotations

from apps.ci.choices import Handoff
from apps.ci.forge import Forge, ForgeEvents, ForgeSettings, ForgeTasks, StatusRules
from apps.core.actors import Actor
from apps.core.causes import Cause
from apps.events.kinds import EventKind
from apps.github.choices import GENERIC_LABELS, STATUS_RANK, WORKFLOW_JOB_PENDING, WorkflowJobStatus
from apps.github.messages import CONVERGE_TASK, HANDOFF_TASK, RECONCILE_TASK, RETIRE_TASK
from apps.github.models import GitHubInstallation, Runner, RunnerClass, WebhookDelivery, WorkflowJob

GITHUB = Forge(
    name="github",
    title="GitHub",
    endpoint=GitHubInstallation,
    runner_class=RunnerClass,
    ci_job=WorkflowJob,
    runner=Runner,
    delivery=WebhookDelivery,
    endpoint_field="installation",
    bound_field="workflow_job",
    runner_id_field="github_runner_id",
    job_relation="runner",
    labels_field="labels",
    endpoint_related=("connection",),
    statuses=StatusRules(
        rank={str(status): rank for status, rank in STATUS_RANK.items()},
        pending=WORKFLOW_JOB_PENDING,
        demand=WorkflowJobStatus.QUEUED,
        started=frozenset({WorkflowJobStatus.IN_PROGRESS, WorkflowJobStatus.COMPLETED}),
        done=frozenset({WorkflowJobStatus.COMPLETED}),
        events={
            WorkflowJobStatus.QUEUED: EventKind.GITHUB_JOB_QUEUED,
            WorkflowJobStatus.IN_PROGRESS: EventKind.GITHUB_JOB_STARTED,
            WorkflowJobStatus.COMPLETED: EventKind.GITHUB_JOB_COMPLETED,
        },
    ),
    events=ForgeEvents(
        job_seen=EventKind.GITHUB_JOB_QUEUED,
        runner_registered=EventKind.GITHUB_RUNNER_REGISTERED,
        runner_refused=EventKind.GITHUB_RUNNER_REFUSED,
        runner_deleted=EventKind.GITHUB_RUNNER_DELETED,
        runner_recycled=EventKind.GITHUB_RUNNER_RECYCLED,
        unavailable=EventKind.GITHUB_UNAVAILABLE,
        available=EventKind.GITHUB_AVAILABLE,
        rate_limited=EventKind.GITHUB_RATE_LIMITED,
        class_created=EventKind.GITHUB_RUNNER_CLASS_CREATED,
        class_updated=EventKind.GITHUB_RUNNER_CLASS_UPDATED,
        class_deleted=EventKind.GITHUB_RUNNER_CLASS_DELETED,
        runner_outdated=EventKind.GITHUB_RUNNER_OUTDATED,
    ),
    tasks=ForgeTasks(
        handoff=HANDOFF_TASK, retire=RETIRE_TASK, converge=CONVERGE_TASK, reconcile=RECONCILE_TASK
    ),
    settings=ForgeSettings(
        reconcile_interval="CATACLOUD_GITHUB_RECONCILE_INTERVAL",
        request_budget="CATACLOUD_GITHUB_REQUEST_BUDGET",
        timeout="CATACLOUD_GITHUB_TIMEOUT",
    ),
    actor=Actor.GITHUB,
    reconciler_actor=Actor.GITHUB_RECONCILER,
    actor_for=Actor.github,
    unavailable_cause=Cause.GITHUB_UNAVAILABLE,
    refused_cause=Cause.GITHUB_REFUSED,
    unavailable_outcome=Handoff.GITHUB_UNAVAILABLE,
    generic_labels=GENERIC_LABELS,
)
