"""How a GitLab runner class's runners are made (:class:`apps.gitlab.choices.RunnerMode`), and
GitLab.com's cap on them.

- **Runner per job**: ``POST /user/runners`` for the machine, deleted once it took its job. GitLab
  counts every runner created or active in a project (group) in the past seven days against its
  plan's cap (GitLab.com: 50 on Free, 1,000 on paid tiers: GitLab issue 342757, MR 175877), so
  a Free project's 51st job of a week gets no runner. Told of a cap (the connection's
  ``runner_cap``, learnt from GitLab's first refusal), Catacloud never asks beyond it: the
  runner job waits in the queue, its pending reason naming the cap and when the oldest of the
  week's runners leaves the window.
- **Class runner**: one runner for the class and scope (its project, or its group), created
  once; every machine of the class runs it with the same token, each a runner manager of its
  own (gitlab-runner's ``system_id``: ``s_`` and 12 characters of the runner job's id, written
  beside its config as ``.runner_system_id``, commands/internal/configfile). No cap, no creation
  call a job. The token is rotated every ``rotate_hours`` and on demand (``POST
  /runners/:id/reset_authentication_token``: the old token is refused from then on, running
  jobs go on with their job tokens); runner jobs handed the old token and not running a CI job
  yet are retired then, and demand starts others with the new one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from apps.ci.client import time_scale
from apps.ci.dispatch import retire_soon
from apps.ci.errors import ForgeError, ForgeRefused
from apps.core.actors import Actor
from apps.core.crypto import encrypt_json
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.gitlab.choices import RunnerScope
from apps.gitlab.client import GitLabClient, RunnerCapReached
from apps.gitlab.forge import GITLAB
from apps.gitlab.models import GitLabClassRunner, GitLabConnection, GitLabRunner, GitLabRunnerClass
from apps.jobs.choices import JOB_LIVE

log = logging.getLogger(__name__)

MIN_MAXIMUM_TIMEOUT = 600  # GitLab refuses a runner's maximum_timeout below 10 minutes
CAP_WINDOW = timedelta(days=7)  # GitLab counts runners created or active in the past seven days


def cap_window() -> timedelta:
    return CAP_WINDOW / time_scale()


@dataclass(frozen=True)
class Where:
    """Where a runner is created: a project, or the class's group."""

    kind: str  # "project" | "group"
    ident: int

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.ident}"


def runner_scope(runner: GitLabRunner) -> Where:
    rc: GitLabRunnerClass = runner.runner_class
    if rc.scope == RunnerScope.GROUP:
        return Where("group", int(rc.group_id or 0))
    record = runner.created_for
    project_id = record.project_id if record is not None else None
    if project_id is None:
        first = runner.connection.projects.order_by("path").first()
        if first is None:
            raise ForgeRefused("no project to create the runner in: the connection lists none")
        project_id = first.project_id
    return Where("project", int(project_id))


def runner_body(rc: GitLabRunnerClass, name: str, where: Where) -> dict[str, Any]:
    """``POST /user/runners``: the class's tags, never untagged jobs, locked to its project."""
    body: dict[str, Any] = {
        "description": name,
        "tag_list": list(rc.tags),
        "run_untagged": False,
        "locked": True,
        "paused": False,
        "maximum_timeout": max(MIN_MAXIMUM_TIMEOUT, rc.timeout_seconds),
    }
    if where.kind == "group":
        body.update(runner_type="group_type", group_id=where.ident)
    else:
        body.update(runner_type="project_type", project_id=where.ident)
    return body


# ---- the cap (runner per job) -------------------------------------------------------------------


def _week_runners(conn: GitLabConnection, where: Where) -> Any:
    """Our runners of this project (group) created in the cap's window, oldest first."""
    rows = GitLabRunner.objects.filter(
        connection=conn, system_id="", registered_at__gte=timezone.now() - cap_window()
    )
    if where.kind == "group":
        rows = rows.filter(runner_class__scope=RunnerScope.GROUP, runner_class__group_id=where.ident)
    else:
        rows = rows.filter(runner_class__scope=RunnerScope.PROJECT, created_for__project_id=where.ident)
    return rows.order_by("registered_at")


def _cap_reached(conn: GitLabConnection, where: Where, cap: int, counted: int) -> RunnerCapReached:
    oldest = _week_runners(conn, where).values_list("registered_at", flat=True).first()
    wait = (oldest + cap_window() - timezone.now()).total_seconds() if oldest else 3600.0 / time_scale()
    return RunnerCapReached(
        f"GitLab's runner cap: {cap} runners created or active in the past seven days per {where.kind} "
        f"({counted} of ours this week in {where.key}); the next leaves the window in {max(0, wait):.0f}s "
        "(or give the class runner_mode class: one runner, no cap)",
        retry_after=max(1.0, wait),
        paced=True,
        scoped=True,
        cap=cap,
    )


def cap_check(conn: GitLabConnection, where: Where) -> None:
    """Refuse (a limit: the runner job waits) a runner beyond the cap GitLab told us of."""
    if not conn.runner_cap:
        return
    counted = _week_runners(conn, where).count()
    if counted >= conn.runner_cap:
        raise _cap_reached(conn, where, conn.runner_cap, counted)


def cap_learnt(conn: GitLabConnection, where: Where, refusal: RunnerCapReached) -> RunnerCapReached:
    """GitLab refused a runner for its cap: the connection knows the cap from now on (asked no
    more beyond it), the refusal is recorded, and the runner job waits for room."""
    GitLabConnection.objects.filter(pk=conn.pk, runner_cap__isnull=True).update(runner_cap=refusal.cap)
    with transaction.atomic():
        event_record(
            kind=EventKind.GITLAB_RUNNER_CAP_REACHED,
            org=conn.org_id,
            actor=Actor.GITLAB,
            reason=refusal.detail[:500],
            scope=where.key,
            cap=refusal.cap,
        )
    return _cap_reached(conn, where, refusal.cap, _week_runners(conn, where).count())


# ---- class runners --------------------------------------------------------------------------------


def class_runner_name(rc: GitLabRunnerClass) -> str:
    return f"catacloud-class-{rc.name}"[:100]


def is_class_runner(runner_id: int) -> bool:
    return GitLabClassRunner.objects.filter(gitlab_runner_id=runner_id).exists()


def class_runner_for(client: GitLabClient, rc: GitLabRunnerClass, where: Where) -> GitLabClassRunner:
    """The class's runner for ``where``, created at GitLab the first time (one creation call for
    the class's life there: the cap counts it once)."""
    found = GitLabClassRunner.objects.filter(runner_class=rc, scope_key=where.key).first()
    if found is not None:
        return found
    created = client.create_runner(runner_body(rc, class_runner_name(rc), where))
    try:
        with transaction.atomic():
            return GitLabClassRunner.objects.create(
                runner_class=rc,
                scope_key=where.key,
                gitlab_runner_id=created.id,
                token_encrypted=encrypt_json({"token": created.token}),
                rotated_at=timezone.now(),
            )
    except IntegrityError:  # another handoff made it meanwhile: ours is one too many
        client.delete_runner(created.id)
        return GitLabClassRunner.objects.get(runner_class=rc, scope_key=where.key)


def class_runner_rotate(*, client: GitLabClient, class_runner: GitLabClassRunner, actor: Actor) -> None:
    """A new token for the class runner; its machines handed the old one and not running a CI
    job are retired (demand starts others, with the new token)."""
    token = client.reset_runner_token(class_runner.gitlab_runner_id)
    now = timezone.now()
    with transaction.atomic():
        GitLabClassRunner.objects.filter(pk=class_runner.pk).update(
            token_encrypted=encrypt_json({"token": token}), rotated_at=now
        )
        stale = GitLabRunner.objects.filter(
            runner_class_id=class_runner.runner_class_id,
            gitlab_runner_id=class_runner.gitlab_runner_id,
            registered_at__lt=now,
            gitlab_job__isnull=True,
            retire_requested_at__isnull=True,
            job__status__in=JOB_LIVE,
        ).exclude(system_id="")
        ids = list(stale.values_list("pk", flat=True))
        stale.update(retire_requested_at=now)
        for pk in ids:
            retire_soon(GITLAB, pk)
        event_record(
            kind=EventKind.GITLAB_RUNNER_TOKEN_ROTATED,
            org=class_runner.runner_class.org_id,
            actor=actor,
            runner_class=class_runner.runner_class.name,
            runner_id=class_runner.gitlab_runner_id,
            scope=class_runner.scope_key,
            retired=len(ids),
        )


def class_runners_rotate_due(client: GitLabClient, conn: GitLabConnection, now: datetime) -> int:
    """The connection's class runners whose token is older than their class's ``rotate_hours``."""
    rotated = 0
    for class_runner in GitLabClassRunner.objects.filter(runner_class__org_id=conn.org_id).select_related(
        "runner_class"
    ):
        every = timedelta(hours=class_runner.runner_class.rotate_hours) / time_scale()
        if class_runner.rotated_at + every <= now:
            class_runner_rotate(client=client, class_runner=class_runner, actor=Actor.GITLAB_RECONCILER)
            rotated += 1
    return rotated


def class_runners_rotate(*, runner_class: GitLabRunnerClass, actor: Actor) -> int:
    """Rotate the class's runner tokens now (on demand: the console's action). Returns how many."""
    conn = GitLabConnection.objects.filter(org_id=runner_class.org_id).first()
    if conn is None:
        return 0
    client = GitLabClient(conn)
    rotated = 0
    for class_runner in GitLabClassRunner.objects.filter(runner_class=runner_class).select_related(
        "runner_class"
    ):
        try:
            class_runner_rotate(client=client, class_runner=class_runner, actor=actor)
        except ForgeError as exc:
            log.warning("class runner %s not rotated: %s", class_runner, exc.detail)
            continue
        rotated += 1
    return rotated
