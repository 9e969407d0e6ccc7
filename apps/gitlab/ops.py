"""What the CI core's GitLab adapter does at GitLab (:class:`GitLabOps`, registered with the core
in apps/control/wiring.py): read a Job event or a job of the jobs API, create a project or group
runner for a machine (``POST /user/runners``: the class's tags, ``run_untagged: false``, a
maximum timeout; its ``glrt-`` token handed to the machine), delete one (``DELETE
/runners/:id``), list the runners, and poll the connected projects' pending and running jobs for
lost deliveries.

A runner is deleted as soon as GitLab says it took a job (its ``running`` event, or the poll),
not when that job ends. GitLab hands a job to whoever asks with a runner's token, however many
that runner runs already (gitlabhq ``lib/api/ci/runner.rb``, ``POST /jobs/request``): pausing
only makes it answer 204 while the token stays valid; a deleted runner's token is refused (403).
Deleting does not fail the running job: its calls are authenticated by its own job token
(``lib/api/ci/helpers/runner.rb``, ``authenticate_job!``: ``job.runner&.heartbeat``) and the
job's ``runner_id`` is merely nulled later (``config/gitlab_loose_foreign_keys.yml``,
``async_nullify``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime
from typing import Any

from django.db.models import Q

from apps.ci.choices import Applied
from apps.ci.errors import ForgeBusy, ForgeNotFound
from apps.ci.forge import Forge, JobReport, Listed, Registration
from apps.ci.records import ci_job_apply
from apps.core.broker import enqueue_on_commit
from apps.gitlab.choices import DONE, GitLabJobStatus, RunnerMode, RunnerScope
from apps.gitlab.client import GitLabClient, JobInfo, RunnerCapReached, mapping, parse_tags, parse_when
from apps.gitlab.messages import RESOLVE_TASK
from apps.gitlab.models import GitLabConnection, GitLabDelivery, GitLabJob, GitLabRunner, GitLabRunnerClass
from apps.gitlab.runners import (
    cap_check,
    cap_learnt,
    class_runner_for,
    class_runner_name,
    class_runners_rotate_due,
    is_class_runner,
    runner_body,
    runner_scope,
)
from apps.gitlab.services import SYSTEM_ID_ENV, TOKEN_ENV, URL_ENV, check_class, runner_command


def _report(
    *,
    gitlab_id: int,
    project_id: int,
    project: str,
    status: str,
    tags: list[str],
    ref: str,
    name: str,
    stage: str,
    pipeline_id: Any,
    pipeline: str,
    runner_id: Any,
    runner_name: str,
    started: datetime | None,
    finished: datetime | None,
    failure_reason: str,
    runner_manager: str = "",
) -> JobReport:
    return JobReport(
        key={"gitlab_id": gitlab_id},
        status=status,
        labels=tags,
        create={
            "project_id": project_id,
            "project": project[:300],
            "pipeline_id": pipeline_id if isinstance(pipeline_id, int) else None,
            "pipeline": pipeline[:300],
            "ref": ref[:300],
            "name": name[:300],
            "stage": stage[:100],
            "tags": tags,
        },
        runner_name=runner_name,
        runner_id=runner_id if isinstance(runner_id, int) else None,
        started_at=started,
        completed_at=finished,
        conclusion=status if status in DONE else "",
        update={"failure_reason": failure_reason[:64]} if status == GitLabJobStatus.FAILED else {},
        runner_manager=runner_manager,
    )


def event_report(payload: Mapping[str, Any], project: str, tags: list[str]) -> JobReport | Applied:
    """A Job event (``object_kind: build``) as the core's report."""
    status = str(payload.get("build_status") or "")
    if status not in GitLabJobStatus.values:
        return Applied.UNKNOWN_STATUS
    try:
        gitlab_id, project_id = int(payload["build_id"]), int(payload["project_id"])
    except (KeyError, TypeError, ValueError):
        return Applied.NOT_A_JOB
    commit, runner = mapping(payload.get("commit")), mapping(payload.get("runner"))
    return _report(
        gitlab_id=gitlab_id,
        project_id=project_id,
        project=project,
        status=status,
        tags=tags,
        ref=str(payload.get("ref") or ""),
        name=str(payload.get("name") or payload.get("build_name") or ""),
        stage=str(payload.get("stage") or payload.get("build_stage") or ""),
        pipeline_id=payload.get("pipeline_id") or commit.get("id"),
        pipeline=str(commit.get("name") or payload.get("ref") or ""),
        runner_id=runner.get("id"),
        runner_name=str(runner.get("description") or ""),
        started=parse_when(payload.get("build_started_at_iso") or payload.get("build_started_at")),
        finished=parse_when(payload.get("build_finished_at_iso") or payload.get("build_finished_at")),
        failure_reason=str(payload.get("build_failure_reason") or ""),
    )


def api_report(job: JobInfo, project_id: int, project: str) -> JobReport | Applied:
    """A job of the jobs API (``GET /projects/:id/jobs``) as the core's report."""
    if job.status not in GitLabJobStatus.values:
        return Applied.UNKNOWN_STATUS
    if job.id is None:
        return Applied.NOT_A_JOB
    return _report(
        gitlab_id=job.id,
        project_id=project_id,
        project=project,
        status=job.status,
        tags=list(job.tags),
        ref=job.ref,
        name=job.name,
        stage=job.stage,
        pipeline_id=job.pipeline_id,
        pipeline=job.pipeline,
        runner_id=job.runner_id,
        runner_name=job.runner_name,
        started=job.started_at,
        finished=job.finished_at,
        failure_reason=job.failure_reason,
        runner_manager=job.runner_manager,
    )


def job_known(connection: GitLabConnection, gitlab_id: int) -> bool:
    """Whether the job has a record here (its class was chosen when it was first seen)."""
    return GitLabJob.objects.filter(connection=connection, gitlab_id=gitlab_id).exists()


def job_bound(connection: GitLabConnection, gitlab_id: int) -> bool:
    """Whether a runner of ours is bound to the job (which machine runs it is known)."""
    return GitLabRunner.objects.filter(
        connection=connection, gitlab_job__gitlab_id=gitlab_id, gitlab_job__connection=connection
    ).exists()


class GitLabOps:
    """The core's :class:`apps.ci.forge.ForgeOps` for GitLab."""

    scope_fields: tuple[str, ...] = ("project_id",)

    def scope_of(self, runner_class: GitLabRunnerClass, values: Mapping[str, Any]) -> str:
        """A project runner serves its own project only; a group runner every project of it."""
        if runner_class.scope == RunnerScope.GROUP:
            return ""
        project = values.get("project_id")
        return str(project) if project is not None else ""

    def client(self, endpoint: GitLabConnection) -> GitLabClient:
        return GitLabClient(endpoint)

    def runner_env(self, record: GitLabJob) -> dict[str, str]:
        return {URL_ENV: record.connection.url}

    def register(self, client: GitLabClient, runner: GitLabRunner, name: str) -> Registration:
        """Per job: a runner for this machine (never beyond a runner cap GitLab told us of); class
        runner mode: the class's runner for the job's scope (made once), this machine one of its
        runner managers (its own system id)."""
        rc: GitLabRunnerClass = runner.runner_class
        where = runner_scope(runner)
        if rc.runner_mode == RunnerMode.CLASS:
            class_runner = class_runner_for(client, rc, where)
            system_id = "s_" + runner.job_id.hex[:12]
            secret = {TOKEN_ENV: class_runner.token, SYSTEM_ID_ENV: system_id}
            return Registration(
                class_runner.gitlab_runner_id, class_runner_name(rc), secret, {"system_id": system_id}, True
            )
        cap_check(runner.connection, where)
        try:
            created = client.create_runner(runner_body(rc, name, where))
        except RunnerCapReached as exc:
            raise cap_learnt(runner.connection, where, exc) from None
        return Registration(created.id, name, {TOKEN_ENV: created.token})

    def delete(
        self, client: GitLabClient, runner: GitLabRunner, runner_id: int, *, background: bool = False
    ) -> bool:
        if runner.system_id:
            return False  # a class runner's machine: the runner serves the class's other machines
        return client.delete_runner(runner_id, background=background)

    def retire(self, client: GitLabClient, runner: GitLabRunner) -> bool:
        """Paused first (it takes no job from now on), then deleted unless it runs one. A class
        runner's machine: nothing to delete, unless its runner manager took a job meanwhile."""
        runner_id = int(runner.gitlab_runner_id or 0)
        if runner.system_id:
            running = client.runner_jobs(runner_id, status=GitLabJobStatus.RUNNING)
            if any(job.runner_manager == runner.system_id for job in running):
                raise ForgeBusy(f"runner manager {runner.system_id} runs a job")
            return False
        try:
            client.pause_runner(runner_id)
            if client.runner_jobs(runner_id, status=GitLabJobStatus.RUNNING):
                raise ForgeBusy(f"runner {runner_id} runs a job")
            return client.delete_runner(runner_id)
        except ForgeNotFound:
            return False

    def listed(self, client: GitLabClient, endpoint: GitLabConnection) -> dict[int, Listed]:
        seen: dict[int, Listed] = {}
        for runner in client.runners():
            seen[runner.id] = Listed(runner.id, runner.description, "", runner.online, None)
        return seen

    def delete_listed(self, client: GitLabClient, listed: Listed) -> bool:
        return client.delete_runner(listed.runner_id, background=True)

    def poll(
        self, forge: Forge, client: GitLabClient, endpoint: GitLabConnection
    ) -> tuple[int, set[tuple[Any, ...]], Q]:
        """The connected projects' pending and running jobs (a record of ours still pending or
        running that they do not list has ended without us hearing)."""
        found = 0
        listed: set[tuple[Any, ...]] = set()
        for project in endpoint.projects.order_by("path"):
            for job in client.project_jobs(project.project_id, ["pending", "running"]):
                report = api_report(job, project.project_id, project.path)
                if isinstance(report, Applied):
                    continue
                listed.add((report.key["gitlab_id"],))
                _, outcome = ci_job_apply(forge=forge, endpoint=endpoint, report=report, source="poll")
                found += outcome.found
        return found, listed, Q(status__in=(GitLabJobStatus.PENDING, GitLabJobStatus.RUNNING))

    def key_of(self, record: GitLabJob) -> tuple[Any, ...]:
        return (record.gitlab_id,)

    def look_up(self, forge: Forge, client: GitLabClient, record: GitLabJob) -> Applied:
        try:
            job = client.job(record.project_id, record.gitlab_id)
        except ForgeNotFound:  # deleted with its pipeline: it will never run
            job = JobInfo.from_api({"id": record.gitlab_id, "status": GitLabJobStatus.CANCELED})
        report = api_report(job, record.project_id, record.project)
        if isinstance(report, Applied):
            return report
        _, outcome = ci_job_apply(forge=forge, endpoint=record.connection, report=report, source="poll")
        return outcome

    def reconcile_extra(
        self, forge: Forge, client: GitLabClient, endpoint: GitLabConnection, now: datetime
    ) -> dict[str, int]:
        """Class runners whose token is due for its rotation (``rotate_hours``) are rotated."""
        return {"class_runner_tokens_rotated": class_runners_rotate_due(client, endpoint, now)}

    def act(self, forge: Forge, delivery: GitLabDelivery, hint: Mapping[str, Any] | None) -> str | None:
        """A Job event. Its tags decide the class: GitLab's events do not carry a job's tags, so
        a job new to us is looked up in the jobs API first (a task: the webhook is answered
        before any call to GitLab), then acted on with the tags it has."""
        payload: dict[str, Any] = delivery.payload
        if payload.get("object_kind") != "build":
            return "ignored"
        conn = delivery.connection
        project = conn.projects.filter(project_id=int(payload.get("project_id") or 0)).first()
        if project is None:
            return "ignored: not a connected project"
        # GitLab's Job events carry the runner's tags, never the job's (data_builder/build.rb)
        tags = parse_tags(hint.get("tag_list")) or [] if hint is not None else None
        report = event_report(payload, project.path, tags or [])
        if isinstance(report, Applied):
            return report
        if (
            report.runner_id is not None
            and not report.runner_manager
            and is_class_runner(report.runner_id)
            and not job_bound(conn, report.key["gitlab_id"])  # its machine is known: no call
        ):
            if hint is None or "runner_manager" not in hint:
                enqueue_on_commit(RESOLVE_TASK, str(delivery.pk))  # which of its machines took it
                return None
            report = replace(report, runner_manager=str(hint["runner_manager"]))
        if tags is None and not job_known(conn, report.key["gitlab_id"]):
            if report.status == GitLabJobStatus.CREATED:
                # Not demand yet (a later stage's job may wait for hours): its tags are looked up
                # when it is pending (that event, or the reconciler's poll, which lists them).
                return "ignored: created, acted on once pending"
            enqueue_on_commit(RESOLVE_TASK, str(delivery.pk))
            return None  # (a job we know had its class chosen when it was first seen)
        _, outcome = ci_job_apply(forge=forge, endpoint=conn, report=report, source="webhook")
        return outcome

    def check_class(self, runner_class: GitLabRunnerClass) -> None:
        check_class(runner_class)

    def outdated(self, exit_code: int) -> str:
        return ""  # gitlab-runner has no such exit: GitLab serves older runners

    def class_config(self, runner_class: GitLabRunnerClass) -> dict[str, Any]:
        return {"command": runner_command(runner_class), "image": runner_class.image}
