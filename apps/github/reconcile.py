"""The reconciler, per installation, every ``CATACLOUD_GITHUB_RECONCILE_INTERVAL`` seconds (30 by
default; sent by the reaper's tick): GitHub's view compared with ours, both ways.

- **Runners**: a runner named ``catacloud-<instance>`` (an instance of this installation's
  database) that no live runner job holds (its machine or job is gone) is deleted, unless it
  is busy or its registration is in flight; a handed-off runner that has not come online
  within its class's ``online_timeout_seconds`` has its machine recycled (terminated: the job
  is requeued on another machine); a runner online and idle past ``idle_timeout_seconds`` is
  retired (deleted at GitHub, its job cancelled, its machine released).
- **Missed webhooks**: the installation's repositories' queued and in-progress runs are polled
  for workflow jobs we never heard of or whose status we missed, with a backoff (the interval
  doubles, up to 10 minutes, while a poll finds nothing; it resets when one finds something),
  and the App's failed deliveries are redelivered. A lost webhook delays a job by at most one
  interval, never hours.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from apps.core.actors import Actor
from apps.core.broker import enqueue
from apps.core.causes import Cause
from apps.core.errors import InvalidTransition
from apps.core.ids import GitHubInstallationId
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.github.choices import RunnerScope, WorkflowJobStatus
from apps.github.client import GitHubClient, GitHubError
from apps.github.demand import workflow_job_apply
from apps.github.dispatch import instance_of, retire_soon
from apps.github.messages import RECONCILE_TASK
from apps.github.models import GitHubInstallation, Runner, RunnerClass, WebhookDelivery, WorkflowJob
from apps.jobs.choices import JOB_LIVE
from apps.machines.lifecycle import instance_terminate
from apps.machines.models import MachineInstance

log = logging.getLogger(__name__)
CLAIM_FOR = timedelta(minutes=5)  # a reconcile that died keeps its claim at most this long
REGISTERING_GRACE = timedelta(minutes=2)
MAX_POLL_INTERVAL = 600.0
MAX_STALE_LOOKUPS = 50
MAX_REDELIVERIES = 20


def interval() -> float:
    return float(settings.CATACLOUD_GITHUB_RECONCILE_INTERVAL)


def reconciles_due(*, now: datetime) -> int:
    """Send a reconcile for every installation whose last one is older than the interval."""
    due = GitHubInstallation.objects.filter(
        Q(reconciled_at__isnull=True) | Q(reconciled_at__lt=now - timedelta(seconds=interval()))
    ).values_list("pk", flat=True)
    sent = 0
    for pk in due:
        sent += enqueue(RECONCILE_TASK, str(pk))
    return sent


def installation_reconcile(
    *, installation_id: GitHubInstallationId, now: datetime | None = None
) -> dict[str, int]:
    """One reconcile of one installation (skipped while another holds it)."""
    now = now or timezone.now()
    claimed = (
        GitHubInstallation.objects.filter(pk=installation_id)
        .filter(Q(reconcile_claimed_at__isnull=True) | Q(reconcile_claimed_at__lt=now - CLAIM_FOR))
        .update(reconcile_claimed_at=now)
    )
    if not claimed:
        return {"skipped": 1}
    report: dict[str, int] = {}
    try:
        inst = GitHubInstallation.objects.select_related("connection").get(pk=installation_id)
        client = GitHubClient(inst)
        try:
            seen = _github_runners(inst, client)
            report.update(_runners(inst, client, seen, now))
            if inst.next_poll_at is None or inst.next_poll_at <= now:
                report.update(_poll(inst, client, now))
            report.update(_redeliver(inst, client, now))
        except GitHubError as exc:  # recorded by the client (availability); the next tick retries
            log.info("reconcile of %s stopped: %s", inst, exc.detail)
            report["github_errors"] = 1
        GitHubInstallation.objects.filter(pk=installation_id).update(reconciled_at=timezone.now())
    finally:
        GitHubInstallation.objects.filter(pk=installation_id).update(reconcile_claimed_at=None)
    return report


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


def _github_runners(inst: GitHubInstallation, client: GitHubClient) -> dict[int, tuple[str, dict[str, Any]]]:
    seen: dict[int, tuple[str, dict[str, Any]]] = {}
    for path in sorted(_owner_paths(inst)):
        for runner in client.list_runners(owner_path=path):
            seen[int(runner["id"])] = (path, runner)
    return seen


def _runners(
    inst: GitHubInstallation, client: GitHubClient, seen: dict[int, tuple[str, dict[str, Any]]], now: datetime
) -> dict[str, int]:
    deleted = recycled = idle = 0
    live = {
        r.github_runner_id: r
        for r in Runner.objects.filter(
            installation=inst, job__status__in=JOB_LIVE, github_runner_id__isnull=False
        ).select_related("job", "runner_class")
    }
    ours = {rid: (path, gh) for rid, (path, gh) in seen.items() if instance_of(str(gh.get("name", "")))}
    known = set(
        str(pk)
        for pk in MachineInstance.objects.filter(
            pk__in=[instance_of(str(gh["name"])) for _, gh in ours.values()]
        ).values_list("pk", flat=True)
    )
    for rid, (path, gh) in ours.items():
        instance_id = instance_of(str(gh["name"]))
        if instance_id not in known:
            continue  # another Catacloud installation's machine: not ours to touch
        runner = live.get(rid)
        if runner is not None:
            if runner.online_at is None and (gh.get("status") == "online" or gh.get("busy")):
                Runner.objects.filter(pk=runner.pk).update(online_at=now)
                runner.online_at = now
            continue
        # A registration of this machine asked for lately may be this very runner, its id not
        # recorded yet when ``live`` was read: left for a later pass.
        registering = Runner.objects.filter(
            installation=inst, registering_instance=instance_id, registering_at__gt=now - REGISTERING_GRACE
        )
        if gh.get("busy") or registering.exists():
            continue
        if client.delete_runner(owner_path=path, runner_id=rid, background=True):
            deleted += 1
            with transaction.atomic():
                event_record(
                    kind=EventKind.GITHUB_RUNNER_DELETED,
                    org=inst.org_id,
                    instance=instance_id,
                    actor=Actor.GITHUB_RECONCILER,
                    runner=gh.get("name"),
                    runner_id=rid,
                    reason="no live runner job holds it (its machine or job is gone)",
                )
    for runner in live.values():
        rid = runner.github_runner_id or 0
        if runner.workflow_job_id or runner.job.instance_id is None or runner.registered_at is None:
            continue
        rc = runner.runner_class
        gh = seen.get(rid, ("", {}))[1]
        if runner.online_at is None:
            if runner.registered_at < now - timedelta(seconds=rc.online_timeout_seconds):
                recycled += _recycle(runner, now)
        elif (
            not gh.get("busy")
            and runner.retire_requested_at is None
            and runner.online_at < now - timedelta(seconds=rc.idle_timeout_seconds)
        ):
            Runner.objects.filter(pk=runner.pk).update(retire_requested_at=now)
            retire_soon(runner.pk)
            idle += 1
    return {"runners_deleted": deleted, "runners_recycled": recycled, "runners_idle_retired": idle}


def _recycle(runner: Runner, now: datetime) -> int:
    """A runner that never came online: its machine is terminated (the job is requeued on
    another one; the registration left behind is deleted by a later pass)."""
    instance_id = runner.job.instance_id
    with transaction.atomic():
        event_record(
            kind=EventKind.GITHUB_RUNNER_RECYCLED,
            org=runner.org_id,
            job=runner.job_id,
            instance=instance_id,
            actor=Actor.GITHUB_RECONCILER,
            runner=runner.name,
            reason=f"not online {runner.runner_class.online_timeout_seconds}s after its handoff",
        )
        if instance_id is None:  # no machine to terminate (what InvalidTransition said before)
            return 0
        with contextlib.suppress(InvalidTransition):
            instance_terminate(
                instance_id=instance_id,
                actor=Actor.GITHUB_RECONCILER,
                reason="its GitHub runner never came online",
                cause=Cause.RUNNER_OFFLINE,
            )
            return 1
    return 0


def _poll(inst: GitHubInstallation, client: GitHubClient, now: datetime) -> dict[str, int]:
    """Workflow jobs we missed: queued and in-progress runs' jobs, then our records GitHub no
    longer lists as pending (looked up one by one, a bounded number)."""
    found = 0
    listed: set[tuple[int, int]] = set()
    for repo in client.repositories():
        full = str(repo.get("full_name", ""))
        runs = {r["id"]: r for status in ("queued", "in_progress") for r in _runs(client, full, status)}
        for run in runs.values():
            for job in client.run_jobs(full, int(run["id"])):
                job = {"workflow_name": run.get("name", ""), **job}
                listed.add((int(job["id"]), int(job.get("run_attempt") or 1)))
                _, outcome = workflow_job_apply(
                    installation=inst, job=job, status=None, repository=full, source="poll"
                )
                found += outcome.found
    stale = WorkflowJob.objects.filter(
        installation=inst,
        status__in=[WorkflowJobStatus.QUEUED, WorkflowJobStatus.WAITING, WorkflowJobStatus.IN_PROGRESS],
        status_changed_at__lt=now - timedelta(seconds=interval()),
    ).order_by("status_changed_at")
    looked = 0
    for record in stale[: MAX_STALE_LOOKUPS * 2]:
        if (record.github_id, record.run_attempt) in listed or looked >= MAX_STALE_LOOKUPS:
            continue
        looked += 1
        job = client.workflow_job(record.repository, record.github_id)
        _, outcome = workflow_job_apply(
            installation=inst, job=job, status=None, repository=record.repository, source="poll"
        )
        found += outcome.found
    base = interval()
    current = inst.poll_interval_seconds or base
    next_interval = base if found else min(MAX_POLL_INTERVAL, current * 2)
    GitHubInstallation.objects.filter(pk=inst.pk).update(
        poll_interval_seconds=next_interval, next_poll_at=now + timedelta(seconds=next_interval)
    )
    return {"missed_jobs_found": found, "jobs_looked_up": looked}


def _runs(client: GitHubClient, repository: str, status: str) -> list[dict[str, Any]]:
    return client._paged(
        f"/repos/{repository}/actions/runs", "workflow_runs", params={"status": status}, background=True
    )


def _redeliver(inst: GitHubInstallation, client: GitHubClient, now: datetime) -> dict[str, int]:
    """Failed deliveries of the App (looked at by one installation of the connection, once per
    interval): each one we never stored, and that no later attempt delivered, is sent again."""
    conn = inst.connection
    first = conn.installations.order_by("created_at", "pk").values_list("pk", flat=True).first()
    if first != inst.pk:
        return {}
    if conn.deliveries_checked_at and conn.deliveries_checked_at > now - timedelta(seconds=interval()):
        return {}
    deliveries = client.hook_deliveries()
    ok_guids = {d.get("guid") for d in deliveries if 200 <= int(d.get("status_code") or 0) < 300}
    failed = [
        d
        for d in deliveries
        if not 200 <= int(d.get("status_code") or 0) < 300 and d.get("guid") not in ok_guids
    ]
    stored = set(
        WebhookDelivery.objects.filter(guid__in=[d.get("guid") for d in failed]).values_list(
            "guid", flat=True
        )
    )
    sent = 0
    done: set[str] = set()
    for delivery in failed:
        guid = str(delivery.get("guid"))
        if guid in stored or guid in done or sent >= MAX_REDELIVERIES:
            continue
        client.redeliver(int(delivery["id"]))
        done.add(guid)
        sent += 1
        with transaction.atomic():
            event_record(
                kind=EventKind.GITHUB_REDELIVERED,
                org=inst.org_id,
                actor=Actor.GITHUB_RECONCILER,
                delivery=guid,
                event=delivery.get("event"),
                action=delivery.get("action"),
            )
    type(conn).objects.filter(pk=conn.pk).update(deliveries_checked_at=now)
    return {"redelivered": sent}
