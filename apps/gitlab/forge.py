"""GitLab, as the CI core (apps.ci) sees it: its tables, statuses, events, tasks and settings.
What it does at GitLab is :class:`apps.gitlab.ops.GitLabOps`."""

from __future__ import annotations

from apps.ci.choices import Handoff
from apps.ci.forge import Forge, ForgeEvents, ForgeSettings, ForgeTasks, StatusRules
from apps.core.actors import Actor
from apps.core.causes import Cause
from apps.events.kinds import EventKind
from apps.gitlab.choices import DONE, NOT_STARTED, STATUS_RANK, GitLabJobStatus
from apps.gitlab.messages import CONVERGE_TASK, FINISHED_TASK, HANDOFF_TASK, RECONCILE_TASK, RETIRE_TASK
from apps.gitlab.models import GitLabConnection, GitLabDelivery, GitLabJob, GitLabRunner, GitLabRunnerClass

GITLAB = Forge(
    name="gitlab",
    title="GitLab",
    endpoint=GitLabConnection,
    runner_class=GitLabRunnerClass,
    ci_job=GitLabJob,
    runner=GitLabRunner,
    delivery=GitLabDelivery,
    endpoint_field="connection",
    bound_field="gitlab_job",
    runner_id_field="gitlab_runner_id",
    job_relation="gitlab_runner",
    labels_field="tags",
    endpoint_related=(),
    statuses=StatusRules(
        rank=STATUS_RANK,
        pending=frozenset(str(s) for s in NOT_STARTED),
        demand=GitLabJobStatus.PENDING,
        started=frozenset(str(s) for s in {GitLabJobStatus.RUNNING, GitLabJobStatus.CANCELING, *DONE}),
        done=frozenset(str(s) for s in DONE),
        events={
            GitLabJobStatus.PENDING: EventKind.GITLAB_JOB_PENDING,
            GitLabJobStatus.RUNNING: EventKind.GITLAB_JOB_STARTED,
            **{str(s): EventKind.GITLAB_JOB_COMPLETED for s in DONE},
        },
    ),
    events=ForgeEvents(
        job_seen=EventKind.GITLAB_JOB_SEEN,
        runner_registered=EventKind.GITLAB_RUNNER_REGISTERED,
        runner_refused=EventKind.GITLAB_RUNNER_REFUSED,
        runner_deleted=EventKind.GITLAB_RUNNER_DELETED,
        runner_recycled=EventKind.GITLAB_RUNNER_RECYCLED,
        unavailable=EventKind.GITLAB_UNAVAILABLE,
        available=EventKind.GITLAB_AVAILABLE,
        rate_limited=EventKind.GITLAB_RATE_LIMITED,
        class_created=EventKind.GITLAB_RUNNER_CLASS_CREATED,
        class_updated=EventKind.GITLAB_RUNNER_CLASS_UPDATED,
        class_deleted=EventKind.GITLAB_RUNNER_CLASS_DELETED,
    ),
    tasks=ForgeTasks(
        handoff=HANDOFF_TASK,
        retire=RETIRE_TASK,
        converge=CONVERGE_TASK,
        reconcile=RECONCILE_TASK,
        finished=FINISHED_TASK,
    ),
    settings=ForgeSettings(
        reconcile_interval="CATACLOUD_GITLAB_RECONCILE_INTERVAL",
        request_budget="CATACLOUD_GITLAB_REQUEST_BUDGET",
        timeout="CATACLOUD_GITLAB_TIMEOUT",
    ),
    actor=Actor.GITLAB,
    reconciler_actor=Actor.GITLAB_RECONCILER,
    actor_for=Actor.gitlab,
    unavailable_cause=Cause.GITLAB_UNAVAILABLE,
    refused_cause=Cause.GITLAB_REFUSED,
    unavailable_outcome=Handoff.GITLAB_UNAVAILABLE,
    manager_field="system_id",
)
