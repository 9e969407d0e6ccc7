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
from django.db.models import Q
from django.utils import timezone

from apps.ci.choices import Applied
from apps.ci.errors import ForgeBusy, ForgeNotFound, ForgeRateLimited
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
# A poll looks at this many active repositories a pass (one call each, plus a queued run's jobs).
POLL_REPOSITORIES = 3
ACTIVE_FOR = timedelta(hours=1)
SWEEP_EVERY = timedelta(hours=1)
QUIET_FOR = timedelta(minutes=5)
# Deliveries are read back to the last check less this (a delivery GitHub lists late is seen).
DELIVERIES_OVERLAP = timedelta(minutes=10)
USER = "User"
# run.sh's exit for a runner version GitHub no longer accepts (Runner.Listener Program.cs,
# Constants.Runner.ReturnCode.RunnerVersionDeprecated), with the env that makes it say so.
OUTDATED_EXIT = 7
RUNNER_EXIT_ENV = {
    "ACTIONS_RUNNER_RETURN_VERSION_DEPRECATED_EXIT_CODE": "1",
    "RUNNER_MANUALLY_TRAP_SIG": "1",
}  # an installation's account type when it is a user's, not an organization's
# GitHub's REST statuses that mean "not started yet" (the poll may see these).
_PENDING_ALIASES = {"requested": WorkflowJobStatus.QUEUED, "pending": WorkflowJobStatus.QUEUED}


def _status(value: str) -> str | None:
    value = _PENDING_ALIASES.get(value, value)
    return value if value in WorkflowJobStatus.values else None


def workflow_job_report(
    job: WorkflowJobInfo, status: str | None, repository: str, public: bool = False
) -> JobReport | Applied:
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
            "public": public,
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
    public: bool = False,
) -> tuple[WorkflowJob | None, Applied]:
    """Record what GitHub says about one workflow job (a ``workflow_job`` delivery's
    ``workflow_job``, or a job the reconciler polled); ``public``: its repository is."""
    report = workflow_job_report(job, status, repository, public)
    if isinstance(report, Applied):
        return None, report
    record, outcome = ci_job_apply(forge=forge, endpoint=installation, report=report, source=source)
    return record, outcome


def repository_scoped(scope: str, public: bool, account_type: str) -> bool:
    """Whether a job's runner is a repository runner: the class says so; or the job's repository
    is public (an organization's runners are in a group, and the Default group serves private
    repositories only: GitHub's "Managing access to self-hosted runners using groups"); or the
    App is installed on a user account (no organization runners: ``/orgs/{login}`` is a 404)."""
    return scope == RunnerScope.REPO or public or account_type == USER


def owner_path(runner: Runner) -> str:
    """Where the runner registers: the installation's organization, or (a repository runner, or
    an account not known yet) the repository of the job it was started for."""
    inst = runner.installation
    record = runner.created_for if runner.created_for_id else None
    repository = record.repository if record is not None else ""
    public = record.public if record is not None else False
    if repository and repository_scoped(runner.runner_class.scope, public, inst.account_type):
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


def _user_account(client: GitHubClient, path: str) -> bool:
    """A 404 on ``/orgs/{login}``: an installation on a user account (GitHub has no organization
    endpoints for it). Learnt, so its runners register at their repositories from now on."""
    inst = client.installation
    if not path.startswith("/orgs/") or inst.account_type == USER:
        return False
    GitHubInstallation.objects.filter(pk=inst.pk).update(account_type=USER)
    inst.account_type = USER
    return True


def _owner_paths(inst: GitHubInstallation) -> set[str]:
    """Where the installation's live runners are registered: its organization (when it is one
    and a class registers there), and the repositories of its repository runners."""
    paths = set()
    scopes = set(RunnerClass.objects.filter(org_id=inst.org_id).values_list("scope", flat=True))
    if RunnerScope.ORG in scopes and inst.account and inst.account_type != USER:
        paths.add(f"/orgs/{inst.account}")
    for repo, public, scope in (
        Runner.objects.filter(installation=inst, job__status__in=JOB_LIVE, created_for__isnull=False)
        .values_list("created_for__repository", "created_for__public", "runner_class__scope")
        .distinct()
    ):
        if repository_scoped(scope, public, inst.account_type):
            paths.add(f"/repos/{repo}")
    return paths


def _learn_account(installation: GitHubInstallation, payload: Mapping[str, Any]) -> None:
    """The account an installation is on (where organization runners register) and whether it
    is a user's (its repository's owner ``type``), from the first delivery that names them."""
    org = payload.get("organization")
    repo = payload.get("repository")
    owner = repo.get("owner") if isinstance(repo, dict) else None
    if (
        not installation.account_type
        and isinstance(owner, dict)
        and owner.get("type") in ("User", "Organization")
    ):
        kind = str(owner["type"])
        GitHubInstallation.objects.filter(pk=installation.pk, account_type="").update(account_type=kind)
        installation.account_type = kind
    if installation.account:
        return
    login = ""
    if isinstance(org, dict):
        login = str(org.get("login") or "")
    elif isinstance(owner, dict):
        login = str(owner.get("login") or "")
    if login:
        GitHubInstallation.objects.filter(pk=installation.pk, account="").update(account=login[:100])
        installation.account = login[:100]


def is_public(repository: Any) -> bool:
    """A repository's visibility as GitHub's JSON says it (``private`` false, or ``visibility``)."""
    if not isinstance(repository, dict):
        return False
    return repository.get("visibility") == "public" or repository.get("private") is False


def active_repositories(inst: GitHubInstallation) -> list[str]:
    """The installation's repositories with a workflow job of ours not finished, or a delivery in
    the last hour: what the poll looks at (sorted)."""
    since = timezone.now() - ACTIVE_FOR
    unfinished = WorkflowJob.objects.filter(installation=inst).exclude(status=WorkflowJobStatus.COMPLETED)
    names = set(unfinished.values_list("repository", flat=True).distinct())
    names |= set(
        WebhookDelivery.objects.filter(installation=inst, received_at__gte=since, event="workflow_job")
        .values_list("payload__repository__full_name", flat=True)
        .distinct()
    )
    return sorted(n for n in names if isinstance(n, str) and n)


def sweep_due(inst: GitHubInstallation) -> bool:
    """Whether the poll looks at every repository this time: none was swept this hour, no
    delivery came lately (a busy installation's lost deliveries are found in its active
    repositories, and by redelivery), and its registrations are not held by a limit (no
    delivery comes then because none of its runners can start: it is busy, not quiet; a sweep
    then would cost a call per repository and find nothing)."""
    now = timezone.now()
    if inst.swept_at is not None and inst.swept_at > now - SWEEP_EVERY:
        return False
    if inst.is_paced(now) or not inst.is_available(now):
        return False
    return not WebhookDelivery.objects.filter(installation=inst, received_at__gte=now - QUIET_FOR).exists()


class GitHubOps:
    """The core's :class:`apps.ci.forge.ForgeOps` for GitHub."""

    scope_fields: tuple[str, ...] = ("repository", "public", "installation__account_type")

    def scope_of(self, runner_class: RunnerClass, values: Mapping[str, Any]) -> str:
        scoped = repository_scoped(
            runner_class.scope,
            bool(values.get("public")),
            str(values.get("installation__account_type") or ""),
        )
        return str(values.get("repository") or "") if scoped else ""

    def client(self, endpoint: GitHubInstallation) -> GitHubClient:
        return GitHubClient(endpoint)

    def runner_env(self, record: WorkflowJob) -> dict[str, str]:
        """actions/runner's run.sh exits 0 when GitHub says the runner's version is deprecated
        (the runner job would "succeed", never online, while its job waits); with these it exits
        7 (src/Misc/layoutroot/run.sh and run-helper.sh.template; RUNNER_MANUALLY_TRAP_SIG makes
        run.sh pass the listener's exit code and forward INT and TERM to it)."""
        return dict(RUNNER_EXIT_ENV)

    def outdated(self, exit_code: int) -> str:
        if exit_code != OUTDATED_EXIT:
            return ""
        return (
            "its actions/runner is a version GitHub no longer accepts (run.sh exited 7): update the "
            "runner in the machines' image (runner_dir) or the class's command; no runner starts "
            "for the class until it is changed"
        )

    def register(self, client: GitHubClient, runner: Runner, name: str) -> Registration:
        """A just-in-time runner (``generate-jitconfig``, the class's labels and runner group);
        a registration left by a crash under this name is deleted and made again."""
        try:
            created = _register(client, owner_path(runner), name, runner.runner_class, runner.job)
        except ForgeNotFound:
            if not _user_account(client, owner_path(runner)):
                raise
            runner.installation.account_type = USER  # its runners are repository runners
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
    ) -> tuple[int, set[tuple[Any, ...]], Q]:
        """The queued runs' jobs of the installation's active repositories (a job of ours not
        finished, or a delivery in the last hour), at most :data:`POLL_REPOSITORIES` a pass, in
        turn (the cursor), so a poll costs O(active repositories) and never all of them at once;
        it stops where its share of the budget ends (dispatch keeps the rest). A queued record of
        ours in a repository it polled whose run is no longer queued went on without us hearing:
        it is looked up."""
        found = 0
        listed: set[tuple[Any, ...]] = set()
        polled: list[str] = []
        active, cursor = active_repositories(endpoint), endpoint.poll_cursor
        turn = ([r for r in active if r > cursor] + [r for r in active if r <= cursor])[:POLL_REPOSITORIES]
        if sweep_due(endpoint):  # quiet for a while, and not swept this hour: every repository
            turn = [r.full_name for r in client.repositories()]
            GitHubInstallation.objects.filter(pk=endpoint.pk).update(swept_at=timezone.now())
        for full in turn:
            try:
                runs = {r.id: r for r in client.runs(full, "queued")}
            except ForgeRateLimited as exc:
                if not exc.paced:
                    raise
                break  # the polls' share is used: dispatch has the rest; the next pass goes on
            GitHubInstallation.objects.filter(pk=endpoint.pk).update(poll_cursor=full[:200])
            polled.append(full)
            # a run whose jobs' deliveries came is not listed again (a call each): the poll is for
            # runs we never heard of
            known = WorkflowJob.objects.filter(installation=endpoint, repository=full, run_id__in=list(runs))
            for github_id, attempt, run_id in known.values_list("github_id", "run_attempt", "run_id"):
                runs.pop(run_id, None)
                listed.add((github_id, attempt))
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
        return found, listed, Q(repository__in=polled, status=WorkflowJobStatus.QUEUED)

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
        """Failed deliveries of the App (looked at by one installation of the connection, when its
        poll is due: at most once an interval, on the poll's backoff): each one we never stored,
        and that no later attempt delivered, is sent again."""
        conn = endpoint.connection
        first = conn.installations.order_by("created_at", "pk").values_list("pk", flat=True).first()
        if first != endpoint.pk:
            return {}
        if endpoint.next_poll_at is not None and endpoint.next_poll_at > now:
            return {}  # read with the poll, on its backoff: both look for lost deliveries
        if conn.deliveries_checked_at and conn.deliveries_checked_at > now - timedelta(
            seconds=interval(forge)
        ):
            return {}
        since = conn.deliveries_checked_at - DELIVERIES_OVERLAP if conn.deliveries_checked_at else None
        deliveries = client.hook_deliveries(since=since)
        ok_guids = {d.guid for d in deliveries if d.ok}
        failed = [d for d in deliveries if d.worth_redelivering and d.guid not in ok_guids]
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
            public=is_public(payload.get("repository")),
        )
        return outcome

    def check_class(self, runner_class: RunnerClass) -> None:
        check_class(runner_class)

    def class_config(self, runner_class: RunnerClass) -> dict[str, Any]:
        return {"command": runner_command(runner_class)}
