"""What the CI core's GitHub adapter does at GitHub (:class:`GitHubOps`, registered with the core
in apps/control/wiring.py): read a ``workflow_job`` (a delivery's or the REST API's), register a
just-in-time runner for a machine (``generate-jitconfig``), delete one, list an installation's
runners, poll its queued and in-progress runs for missed deliveries, and redeliver the App's
failed deliveries."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction

from apps.ci.choices import Applied
from apps.ci.errors import ForgeBusy
from apps.ci.forge import Forge, JobReport, Listed, Registration
from apps.ci.reconcile import interval
from apps.ci.records import ci_job_apply
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.github.choices import RunnerScope, WorkflowJobStatus
from apps.github.client import (
    GitHubClient,
    GitHubConflict,
    GitHubUnprocessable,
    JitRunner,
    WorkflowJobInfo,
)
from apps.github.models import GitHubInstallation, Runner, RunnerClass, WebhookDelivery, WorkflowJob
from apps.github.services import JIT_ENV, check_class, runner_command
from apps.jobs.choices import JOB_LIVE
from apps.jobs.models import Job

MAX_REDELIVERIES = 20
# GitHub's REST statuses that mean "not started yet" (the poll may see these).
_PENDING_ALIASES = {"requested": WorkflowJobStatus.QUEUED, "pending": WorkflowJobStatus.QUEUED}


def _status(value: str) -> str | None:
    value = _PENDING_ALIASES.get(value, value)
    return value if value in WorkflowJobStatus.values else None


def workflow_job_report(job: WorkflowJobInfo, status: str | None, repository: str) -> JobReport | Applied:
    """A ``workflow_job`` (a delivery's, or the REST API's) as the core's report."""
    status = _status(status or job.status)
    if status is None:
        return Applied.UNKNOWN_STATUS
    if job.id is None or job.run_id is None or job.run_attempt is None:
        return Applied.NOT_A_WORKFLOW_JOB
    labels = list(job.labels)
    return JobReport(
        key={"github_id": job.id, "run_attempt": job.run_attempt},
        status=status,
        labels=labels,
        create={
            "run_id": job.run_id,
            "repository": repository[:200],
            "workflow": (job.workflow_name or "")[:300],
            "name": job.name[:300],
            "labels": labels,
        },
        runner_name=job.runner_name,
        runner_id=job.runner_id,
        started_at=job.started_at,
        completed_at=job.completed_at,
        conclusion=job.conclusion,
    )


def workflow_job_apply(
    *,
    forge: Forge,
    installation: GitHubInstallation,
    job: WorkflowJobInfo,
    status: str | None,
    repository: str,
    source: str,
) -> tuple[WorkflowJob | None, Applied]:
    """Record what GitHub says about one workflow job (a ``workflow_job`` delivery's
    ``workflow_job``, or a job the reconciler polled)."""
    report = workflow_job_report(job, status, repository)
    if isinstance(report, Applied):
        return None, report
    record, outcome = ci_job_apply(forge=forge, endpoint=installation, report=report, source=source)
    return record, outcome


def owner_path(runner: Runner) -> str:
    """Where the runner registers: the installation's organization, or (scope repo, or an
    account not known yet) the repository of the job it was started for."""
    inst = runner.installation
    repository = runner.created_for.repository if runner.created_for_id and runner.created_for else ""
    if runner.runner_class.scope == RunnerScope.REPO and repository:
        return f"/repos/{repository}"
    account = inst.account or (repository.split("/")[0] if repository else "")
    return f"/orgs/{account}"


def _register(client: GitHubClient, path: str, name: str, rc: RunnerClass, job: Job) -> JitRunner:
    labels, group = list(rc.labels), rc.runner_group_id
    try:
        return client.generate_jitconfig(owner_path=path, name=name, labels=labels, runner_group_id=group)
    except GitHubConflict:
        pass
    # A runner with this name exists: an earlier handoff that crashed after GitHub answered,
    # or the machine's previous runner still registered. Delete it if it is idle; a busy one
    # keeps its name and this runner gets another.
    existing = client.runner_by_name(owner_path=path, name=name)
    if existing is not None and not existing.busy:
        try:
            client.delete_runner(owner_path=path, runner_id=existing.id)
            return client.generate_jitconfig(owner_path=path, name=name, labels=labels, runner_group_id=group)
        except (GitHubConflict, GitHubUnprocessable):
            pass
    suffix = str(job.pk)[:8] + f"-{job.attempt}"
    return client.generate_jitconfig(
        owner_path=path, name=f"{name}-{suffix}", labels=labels, runner_group_id=group
    )


def _owner_paths(inst: GitHubInstallation) -> set[str]:
    paths = set()
    scopes = set(RunnerClass.objects.filter(org_id=inst.org_id).values_list("scope", flat=True))
    if RunnerScope.ORG in scopes and inst.account:
        paths.add(f"/orgs/{inst.account}")
    if RunnerScope.REPO in scopes:
        for repo in (
            Runner.objects.filter(installation=inst, job__status__in=JOB_LIVE, created_for__isnull=False)
            .values_list("created_for__repository", flat=True)
            .distinct()
        ):
            paths.add(f"/repos/{repo}")
    return paths


def _learn_account(installation: GitHubInstallation, payload: Mapping[str, Any]) -> None:
    """The account an installation is on (where organization runners register), from the first
    delivery that names it."""
    if installation.account:
        return
    org = payload.get("organization")
    repo = payload.get("repository")
    login = ""
    if isinstance(org, dict):
        login = str(org.get("login") or "")
    elif isinstance(repo, dict) and isinstance(repo.get("owner"), dict):
        login = str(repo["owner"].get("login") or "")
    if login:
        GitHubInstallation.objects.filter(pk=installation.pk, account="").update(account=login[:100])
        installation.account = login[:100]


class GitHubOps:
    """The core's :class:`apps.ci.forge.ForgeOps` for GitHub."""

    def client(self, endpoint: GitHubInstallation) -> GitHubClient:
        return GitHubClient(endpoint)

    def runner_env(self, record: WorkflowJob) -> dict[str, str]:
        return {}

    def register(self, client: GitHubClient, runner: Runner, name: str) -> Registration:
        """A just-in-time runner (``generate-jitconfig``, the class's labels and runner group);
        a registration left by a crash under this name is deleted and made again."""
        created = _register(client, owner_path(runner), name, runner.runner_class, runner.job)
        return Registration(created.runner_id, created.name, {JIT_ENV: created.encoded_jit_config})

    def delete(
        self, client: GitHubClient, runner: Runner, runner_id: int, *, background: bool = False
    ) -> bool:
        return client.delete_runner(owner_path=owner_path(runner), runner_id=runner_id, background=background)

    def retire(self, client: GitHubClient, runner: Runner) -> bool:
        try:
            return client.delete_runner(
                owner_path=owner_path(runner), runner_id=int(runner.github_runner_id or 0)
            )
        except GitHubUnprocessable as exc:  # GitHub refuses while it runs a job
            raise ForgeBusy(exc.detail, exc.status) from None

    def listed(self, client: GitHubClient, endpoint: GitHubInstallation) -> dict[int, Listed]:
        seen: dict[int, Listed] = {}
        for path in sorted(_owner_paths(endpoint)):
            for runner in client.list_runners(owner_path=path):
                seen[runner.id] = Listed(runner.id, runner.name, path, runner.online, runner.busy)
        return seen

    def delete_listed(self, client: GitHubClient, listed: Listed) -> bool:
        return client.delete_runner(owner_path=listed.where, runner_id=listed.runner_id, background=True)

    def poll(
        self, forge: Forge, client: GitHubClient, endpoint: GitHubInstallation
    ) -> tuple[int, set[tuple[Any, ...]]]:
        """The installation's repositories' queued and in-progress runs' jobs."""
        found = 0
        listed: set[tuple[Any, ...]] = set()
        for repo in client.repositories():
            full = repo.full_name
            runs = {r.id: r for status in ("queued", "in_progress") for r in client.runs(full, status)}
            for run in runs.values():
                for job in client.run_jobs(full, run.id):
                    if job.workflow_name is None:
                        job = replace(job, workflow_name=run.name)
                    listed.add((job.id, job.run_attempt))
                    _, outcome = workflow_job_apply(
                        forge=forge,
                        installation=endpoint,
                        job=job,
                        status=None,
                        repository=full,
                        source="poll",
                    )
                    found += outcome.found
        return found, listed

    def key_of(self, record: WorkflowJob) -> tuple[Any, ...]:
        return (record.github_id, record.run_attempt)

    def look_up(self, forge: Forge, client: GitHubClient, record: WorkflowJob) -> Applied:
        job = client.workflow_job(record.repository, record.github_id)
        _, outcome = workflow_job_apply(
            forge=forge,
            installation=record.installation,
            job=job,
            status=None,
            repository=record.repository,
            source="poll",
        )
        return outcome

    def reconcile_extra(
        self, forge: Forge, client: GitHubClient, endpoint: GitHubInstallation, now: datetime
    ) -> dict[str, int]:
        """Failed deliveries of the App (looked at by one installation of the connection, once per
        interval): each one we never stored, and that no later attempt delivered, is sent again."""
        conn = endpoint.connection
        first = conn.installations.order_by("created_at", "pk").values_list("pk", flat=True).first()
        if first != endpoint.pk:
            return {}
        if conn.deliveries_checked_at and conn.deliveries_checked_at > now - timedelta(
            seconds=interval(forge)
        ):
            return {}
        deliveries = client.hook_deliveries()
        ok_guids = {d.guid for d in deliveries if d.ok}
        failed = [d for d in deliveries if not d.ok and d.guid not in ok_guids]
        stored = set(
            WebhookDelivery.objects.filter(guid__in=[d.guid for d in failed]).values_list("guid", flat=True)
        )
        sent = 0
        done: set[str] = set()
        for delivery in failed:
            guid = str(delivery.guid)
            if guid in stored or guid in done or sent >= MAX_REDELIVERIES:
                continue
            client.redeliver(delivery.id)
            done.add(guid)
            sent += 1
            with transaction.atomic():
                event_record(
                    kind=EventKind.GITHUB_REDELIVERED,
                    org=endpoint.org_id,
                    actor=forge.reconciler_actor,
                    delivery=guid,
                    event=delivery.event,
                    action=delivery.action,
                )
        type(conn).objects.filter(pk=conn.pk).update(deliveries_checked_at=now)
        return {"redelivered": sent}

    def act(self, forge: Forge, delivery: WebhookDelivery, hint: Mapping[str, Any] | None) -> str:
        payload: dict[str, Any] = delivery.payload
        installation = delivery.installation
        _learn_account(installation, payload)
        if delivery.event != "workflow_job":
            return "ignored"
        job = payload.get("workflow_job")
        repository = (
            (payload.get("repository") or {}).get("full_name", "")
            if isinstance(payload.get("repository"), dict)
            else ""
        )
        if not isinstance(job, dict) or not repository:
            return "ignored: no workflow_job"
        _, outcome = workflow_job_apply(
            forge=forge,
            installation=installation,
            job=WorkflowJobInfo.from_api(job),
            status=delivery.action or None,
            repository=str(repository),
            source="webhook",
        )
        return outcome

    def check_class(self, runner_class: RunnerClass) -> None:
        check_class(runner_class)

    def class_config(self, runner_class: RunnerClass) -> dict[str, Any]:
        return {"command": runner_command(runner_class)}
