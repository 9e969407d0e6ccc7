"""GitHub Actions tests: the org of the world connected to a fake GitHub (a thread), one
installation on account ``acme`` with two repositories, and a runner class."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from testkit.github_fake import FakeGitHub, app_keypair, sign
from tests.admin.conftest import ops  # noqa: F401  (the console's operator, logged in)
from tests.conftest import World

SECRET = "webhook-secret-of-acme"
LABELS = ["self-hosted", "catacloud-linux-2cpu"]
INSTALLATION = 42


@pytest.fixture(scope="session")
def app_key() -> tuple[str, str]:
    return app_keypair()


@pytest.fixture
def fake_github(app_key: tuple[str, str]) -> Iterator[FakeGitHub]:
    fake = FakeGitHub(app_id=7, public_key=app_key[1], webhook_secret=SECRET).start()
    fake.add_installation(INSTALLATION, "acme", ["acme/app", "acme/lib"])
    try:
        yield fake
    finally:
        fake.stop()


@dataclass
class GitHubWorld:
    world: World
    fake: FakeGitHub
    connection: Any
    installation: Any
    runner_class: Any

    def deliver(
        self,
        event: str,
        payload: dict[str, Any],
        *,
        guid: str | None = None,
        secret: str = SECRET,
        **headers: str,
    ) -> Any:
        return deliver(event, payload, guid=guid, secret=secret, **headers)


def deliver(
    event: str,
    payload: dict[str, Any],
    *,
    guid: str | None = None,
    secret: str = SECRET,
    body: bytes | None = None,
    **headers: str,
) -> Any:
    """POST a delivery to the webhook as GitHub would (signed with ``secret``)."""
    from django.test import Client

    raw = body if body is not None else json.dumps(payload).encode()
    extra = {
        "HTTP_X_GITHUB_EVENT": event,
        "HTTP_X_GITHUB_DELIVERY": guid or str(uuid.uuid4()),
        "HTTP_X_HUB_SIGNATURE_256": sign(secret, raw),
        **{f"HTTP_{k.upper()}": v for k, v in headers.items()},
    }
    return Client().post("/api/integrations/github/webhook", raw, content_type="application/json", **extra)


def workflow_job(
    job_id: int,
    action: str,
    *,
    labels: list[str] | None = None,
    runner_name: str | None = None,
    repository: str = "acme/app",
    installation: int = INSTALLATION,
    run_attempt: int = 1,
    conclusion: str | None = None,
    runner_id: int | None = None,
) -> dict[str, Any]:
    """A ``workflow_job`` delivery's payload, shaped like GitHub's."""
    return {
        "action": action,
        "workflow_job": {
            "id": job_id,
            "run_id": job_id * 10,
            "run_attempt": run_attempt,
            "workflow_name": "CI",
            "name": f"build-{job_id}",
            "labels": labels if labels is not None else list(LABELS),
            "status": action,
            "conclusion": conclusion,
            "runner_name": runner_name,
            "runner_id": runner_id,
            "started_at": "2026-11-25T10:00:00Z",
            "completed_at": "2026-11-25T10:05:00Z" if action == "completed" else None,
        },
        "repository": {"full_name": repository, "owner": {"login": repository.split("/")[0]}},
        "organization": {"login": repository.split("/")[0]},
        "installation": {"id": installation},
    }


@pytest.fixture
def gh(world: World, fake_github: FakeGitHub, app_key: tuple[str, str]) -> GitHubWorld:
    return _connected(world, fake_github, app_key)


@pytest.fixture
def tgh(tworld: World, fake_github: FakeGitHub, app_key: tuple[str, str]) -> GitHubWorld:
    """The same, committed (for a test with a worker)."""
    return _connected(tworld, fake_github, app_key)


def _connected(world: World, fake_github: FakeGitHub, app_key: tuple[str, str]) -> GitHubWorld:
    from apps.github.services import connection_set, runner_class_save

    conn, _ = connection_set(
        org=world.org,
        app_id=7,
        api_url=fake_github.url,
        private_key=app_key[0],
        webhook_secret=SECRET,
        installations=[{"id": INSTALLATION, "account": "acme"}],
        actor="test",
    )
    rc, _ = runner_class_save(org=world.org, name="small", labels=LABELS, machine_type=world.machine_type)
    return GitHubWorld(world, fake_github, conn, conn.installations.get(), rc)
