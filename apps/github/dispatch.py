"""Dispatch: a runner job assigned to a machine gets a just-in-time runner registration from
GitHub, handed to the machine's agent as a secret; a runner no longer needed is deleted at
GitHub and its job cancelled.

The registration is named ``catacloud-<instance id>`` and carries the class's labels. The
intent (which machine it is for) is committed before the call; the runner id after it. The
encoded configuration goes only into the job's encrypted secret env (apps.jobs.handoff): never
into a log line, an event or an API answer, and it is erased when the job ends.
"""

from __future__ import annotations

import contextlib
import logging

from django.db import transaction
from django.utils import timezone

from apps.core.actors import Actor
from apps.core.broker import enqueue, enqueue_on_commit
from apps.core.causes import Cause
from apps.core.errors import InvalidTransition
from apps.core.ids import InstanceId, JobId, RunnerId
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.github.availability import hold_reason
from apps.github.choices import Handoff, RunnerScope
from apps.github.client import (
    GitHubClient,
    GitHubConflict,
    GitHubError,
    GitHubRateLimited,
    GitHubRefused,
    GitHubUnavailable,
    GitHubUnprocessable,
    JitRunner,
)
from apps.github.messages import HANDOFF_TASK, RETIRE_TASK
from apps.github.models import Runner
from apps.github.services import JIT_ENV
from apps.jobs.choices import JOB_LIVE
from apps.jobs.handoff import awaits_handoff, job_handed_off, job_handoff_failed
from apps.jobs.models import Job
from apps.jobs.submission import job_cancel

log = logging.getLogger(__name__)
NAME_PREFIX = "catacloud-"


def runner_name(instance_id: InstanceId, suffix: str = "") -> str:
    return f"{NAME_PREFIX}{instance_id}{('-' + suffix) if suffix else ''}"


def instance_of(name: str) -> str | None:
    """The instance id in a runner name of ours (``catacloud-<uuid>[-suffix]``), else None."""
    if not name.startswith(NAME_PREFIX):
        return None
    rest = name[len(NAME_PREFIX) :]
    candidate = rest[:36]
    return candidate if len(candidate) == 36 and candidate.count("-") == 4 else None


def owner_path(runner: Runner) -> str:
    """Where the runner registers: the installation's organization, or (scope repo, or an
    account not known yet) the repository of the job it was started for."""
    inst = runner.installation
    repository = runner.created_for.repository if runner.created_for_id and runner.created_for else ""
    if runner.runner_class.scope == RunnerScope.REPO and repository:
        return f"/repos/{repository}"
    account = inst.account or (repository.split("/")[0] if repository else "")
    return f"/orgs/{account}"


def runner_handoff_soon(*, job_id: JobId) -> None:
    """The ``job_needs_handoff`` hook: the handoff needs a GitHub call, so it runs in a task."""
    enqueue(HANDOFF_TASK, str(job_id))


def _load(job_id: JobId) -> Runner | None:
    return (
        Runner.objects.select_related("job", "runner_class", "installation__connection", "created_for")
        .filter(job_id=job_id)
        .first()
    )


def runner_handoff(*, job_id: JobId) -> Handoff:
    """Register a just-in-time runner for the machine the job is assigned to and hand its
    configuration to the agent. Idempotent: a job already handed off (or no longer assigned)
    is left alone; a registration left by a crash is deleted and made again."""
    runner = _load(job_id)
    if runner is None or not awaits_handoff(runner.job):
        return Handoff.NOTHING_TO_DO
    job, inst, rc = runner.job, runner.installation, runner.runner_class
    instance_id = job.instance_id
    if instance_id is None:  # awaits_handoff: assigned, so on a machine
        return Handoff.NOTHING_TO_DO
    name = runner_name(instance_id)
    Runner.objects.filter(pk=runner.pk).update(
        name=name, registering_instance=instance_id, registering_at=timezone.now()
    )
    client = GitHubClient(inst)
    path = owner_path(runner)
    try:
        created = _register(client, path, name, rc.labels, rc.runner_group_id, job)
    except (GitHubUnavailable, GitHubRateLimited) as exc:
        inst.refresh_from_db(fields=["unavailable_until", "unavailable_reason"])
        job_handoff_failed(
            job_id=job.pk,
            instance_id=instance_id,
            cause=Cause.GITHUB_UNAVAILABLE,
            detail=exc.detail,
            actor=Actor.GITHUB,
            hold_reason=hold_reason(inst) or f"GitHub unavailable: {exc.detail}"[:300],
        )
        return Handoff.GITHUB_UNAVAILABLE
    except GitHubRefused as exc:
        with transaction.atomic():
            if job_handoff_failed(
                job_id=job.pk,
                instance_id=instance_id,
                cause=Cause.GITHUB_REFUSED,
                detail=f"GitHub refused the runner registration: {exc.detail}",
                actor=Actor.GITHUB,
                permanent=True,
            ):
                event_record(
                    kind=EventKind.GITHUB_RUNNER_REFUSED,
                    org=job.org_id,
                    job=job,
                    instance=instance_id,
                    actor=Actor.GITHUB,
                    reason=exc.detail[:500],
                    runner_class=rc.name,
                )
        return Handoff.REFUSED
    with transaction.atomic():
        handed = job_handed_off(
            job_id=job.pk,
            instance_id=instance_id,
            secret_env={JIT_ENV: created.encoded_jit_config},
            actor=Actor.GITHUB,
        )
        if handed:
            Runner.objects.filter(pk=runner.pk).update(
                name=created.name,
                github_runner_id=created.runner_id,
                registered_instance=instance_id,
                registered_at=timezone.now(),
                online_at=None,
            )
            event_record(
                kind=EventKind.GITHUB_RUNNER_REGISTERED,
                org=job.org_id,
                job=job,
                instance=instance_id,
                actor=Actor.GITHUB,
                runner=created.name,
                runner_id=created.runner_id,
                runner_class=rc.name,
                labels=rc.labels,
            )
    if not handed:  # the job moved on while we asked: the registration is nobody's
        _delete_quietly(client, path, created.runner_id)
        return Handoff.JOB_MOVED_ON
    return Handoff.HANDED_OFF


def _register(
    client: GitHubClient, path: str, name: str, labels: list[str], group: int, job: Job
) -> JitRunner:
    try:
        return client.generate_jitconfig(owner_path=path, name=name, labels=labels, runner_group_id=group)
    except GitHubConflict:
        pass
    # A runner with this name exists: an earlier handoff that crashed after GitHub answered,
    # or the machine's previous runner still registered. Delete it if it is idle; a busy one
    # keeps its name and this runner gets another.
    existing = client.runner_by_name(owner_path=path, name=name)
    if existing is not None and not existing.get("busy"):
        try:
            client.delete_runner(owner_path=path, runner_id=int(existing["id"]))
            return client.generate_jitconfig(owner_path=path, name=name, labels=labels, runner_group_id=group)
        except (GitHubConflict, GitHubUnprocessable):
            pass
    suffix = str(job.pk)[:8] + f"-{job.attempt}"
    return client.generate_jitconfig(
        owner_path=path, name=f"{name}-{suffix}", labels=labels, runner_group_id=group
    )


def _delete_quietly(client: GitHubClient, path: str, runner_id: int) -> None:
    try:
        client.delete_runner(owner_path=path, runner_id=runner_id)
    except GitHubError as exc:  # the reconciler deletes it later (its machine is not its own)
        log.info("runner %s not deleted now (%s); the reconciler will", runner_id, exc.detail)


def runner_retire(*, job_id: JobId) -> Handoff:
    """A runner no longer needed (demand fell, or idle past its deadline): delete its
    registration at GitHub (refused while it runs a job: then it stays, bound to that job),
    then cancel its Catacloud job (the agent stops it; the machine follows retention)."""
    runner = _load(job_id)
    if runner is None or runner.job.status not in JOB_LIVE or runner.workflow_job_id:
        return Handoff.NOTHING_TO_DO
    job = runner.job
    if runner.github_runner_id and not awaits_handoff(job) and job.handed_off_to:
        client = GitHubClient(runner.installation)
        try:
            client.delete_runner(owner_path=owner_path(runner), runner_id=runner.github_runner_id)
        except GitHubUnprocessable:  # busy: GitHub gave it a job; the job's delivery binds it
            Runner.objects.filter(pk=runner.pk).update(retire_requested_at=None)
            return Handoff.BUSY
        except (GitHubUnavailable, GitHubRateLimited):
            return Handoff.GITHUB_UNAVAILABLE  # retire_requested_at stays: the reconciler retries
        with transaction.atomic():
            event_record(
                kind=EventKind.GITHUB_RUNNER_DELETED,
                org=job.org_id,
                job=job,
                instance=job.instance_id,
                actor=Actor.GITHUB,
                runner=runner.name,
                runner_id=runner.github_runner_id,
                reason="no queued job needs it",
            )
    with contextlib.suppress(InvalidTransition):  # it ended meanwhile: nothing left to stop
        job_cancel(job=job, actor=Actor.GITHUB)
    return Handoff.RETIRED


def retire_soon(runner_pk: RunnerId) -> None:
    enqueue_on_commit(RETIRE_TASK, str(runner_pk))
