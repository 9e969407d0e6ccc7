"""GitLab CI tests: the org of the world connected to a fake GitLab (a thread) serving two
projects of acme's (``acme/app``, and ``acme/lib`` in group 7), and a runner class."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from testkit.gitlab_fake import FakeGitLab
from tests.admin.conftest import ops  # noqa: F401  (the console's operator, logged in)
from tests.conftest import World

TOKEN = "glpat-acme-access-token-1234"
SECRET = "gitlab-webhook-secret-of-acme"
TAGS = ["catacloud", "linux-2cpu"]
APP, LIB = 12, 13
TAGS_OF_THE_JOB = "_tags_of_the_job"  # kept aside by job_event(), never sent (GitLab sends none)


@pytest.fixture
def fake_gitlab() -> Iterator[FakeGitLab]:
    fake = FakeGitLab(token=TOKEN, webhook_token=SECRET).start()
    fake.add_project(APP, "acme/app")
    fake.add_project(LIB, "acme/lib", group_id=7)
    try:
        yield fake
    finally:
        fake.stop()


@dataclass
class GitLabWorld:
    world: World
    fake: FakeGitLab
    connection: Any
    runner_class: Any


def deliver(
    payload: dict[str, Any],
    *,
    key: str | None = None,
    token: str = SECRET,
    event: str = "Job Hook",
    body: bytes | None = None,
    **headers: str,
) -> Any:
    """POST a Job event to the webhook as GitLab would (its secret token, an idempotency key).
    GitLab's events never carry the job's tags: a payload made with ``tags`` (:func:`job_event`)
    is sent without them, and when the event waits for its tags, acted on with them as the
    look-up task would (without its call: the tests' jobs are not the fake's)."""
    from django.test import Client

    from apps.ci.intake import delivery_process
    from apps.gitlab.forge import GITLAB

    payload = dict(payload)
    tags = payload.pop(TAGS_OF_THE_JOB, None)
    raw = body if body is not None else json.dumps(payload).encode()
    key = key or str(uuid.uuid4())
    extra = {
        "HTTP_X_GITLAB_EVENT": event,
        "HTTP_X_GITLAB_TOKEN": token,
        "HTTP_IDEMPOTENCY_KEY": key,
        **{f"HTTP_{k.upper()}": v for k, v in headers.items()},
    }
    answer = Client().post("/api/integrations/gitlab/webhook", raw, content_type="application/json", **extra)
    if tags is not None and answer.status_code == 200 and answer.json().get("status") == "deferred":
        outcome = delivery_process(forge=GITLAB, key=key, hint={"tag_list": tags})
        return SimpleNamespace(status_code=200, json=lambda: {"status": outcome}, content=b"")
    return answer


def job_event(
    job_id: int,
    status: str,
    *,
    tags: list[str] | None = None,
    runner: dict[str, Any] | None = None,
    project_id: int = APP,
    pipeline: str = "CI",
    failure_reason: str = "unknown_failure",
) -> dict[str, Any]:
    """A Job event's payload, shaped like GitLab's (never the job's tags: ``tags`` are kept
    aside for :func:`deliver`, which sends the event without them)."""
    payload: dict[str, Any] = {
        "object_kind": "build",
        "ref": "main",
        "tag": False,
        "build_id": job_id,
        "build_name": f"build-{job_id}",
        "build_stage": "test",
        "build_status": status,
        "build_created_at": "2026-11-25 10:00:00 UTC",
        "build_started_at": "2026-11-25 10:01:00 UTC" if status not in ("created", "pending") else None,
        "build_finished_at": "2026-11-25 10:05:00 UTC"
        if status in ("success", "failed", "canceled")
        else None,
        "build_failure_reason": failure_reason,
        "pipeline_id": job_id * 10,
        "runner": runner,
        "project_id": project_id,
        "project_name": "acme / app",
        "commit": {"id": job_id * 10, "name": pipeline, "status": status},
    }
    if tags is not None:
        payload[TAGS_OF_THE_JOB] = tags
    return payload


@pytest.fixture
def gl(world: World, fake_gitlab: FakeGitLab) -> GitLabWorld:
    return _connected(world, fake_gitlab)


@pytest.fixture
def tgl(tworld: World, fake_gitlab: FakeGitLab) -> GitLabWorld:
    """The same, committed (for a test whose code commits: a task run as a worker runs it)."""
    return _connected(tworld, fake_gitlab)


def _connected(world: World, fake_gitlab: FakeGitLab) -> GitLabWorld:
    from apps.core.actors import Actor
    from apps.gitlab.services import connection_set, runner_class_save

    conn, _ = connection_set(
        org=world.org,
        url=fake_gitlab.url,
        token=TOKEN,
        webhook_token=SECRET,
        projects=[{"id": APP, "path": "acme/app"}, {"id": LIB, "path": "acme/lib"}],
        actor=Actor.TESTKIT,
    )
    rc, _ = runner_class_save(org=world.org, name="small", tags=TAGS, machine_type=world.machine_type)
    return GitLabWorld(world, fake_gitlab, conn, rc)
