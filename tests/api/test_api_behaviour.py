"""What a user of the API notices: tokens, one error format, pagination, filters, privileges."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.test import override_settings
from django.utils import timezone

from apps.core.crypto import hash_token
from apps.events.services import event_record
from apps.jobs.models import JobConfiguration
from apps.orgs.models import ApiToken, Privilege
from apps.orgs.services import api_token_create
from apps.resources.models import ResourceType
from tests.conftest import World

pytestmark = pytest.mark.django_db


def test_token_is_shown_once_and_stored_hashed(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    call_command("create_api_token", "--org", "acme", "--user", "member")
    secret = capsys.readouterr().out.strip()
    assert secret.startswith("cc_") and len(secret) > 40
    token = ApiToken.objects.get(token_hash=hash_token(secret))
    assert secret not in {token.prefix, token.token_hash}
    assert world.client("member").get("/api/v1/events/").status_code == 200
    response = world.client("anonymous")
    response.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert response.get("/api/v1/job-configs/").status_code == 200
    token.refresh_from_db()
    assert token.last_used_at is not None


def test_revoked_and_expired_tokens_stop_working(world: World) -> None:
    client = world.client("member")
    assert client.get("/api/v1/events/").status_code == 200
    call_command("revoke_api_token", "--user", "member")
    response = client.get("/api/v1/events/")
    assert response.status_code == 401 and response.json()["code"] == "authentication_failed"

    _, secret = api_token_create(
        org=world.org, user=world.users["viewer"], expires_at=timezone.now() - timedelta(1)
    )
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    response = client.get("/api/v1/events/")
    assert response.status_code == 401 and response.json()["detail"] == "token expired"


def test_a_token_can_be_narrower_than_its_user(world: World) -> None:
    _, secret = api_token_create(org=world.org, user=world.users["admin"], role="viewer")
    client = world.client("anonymous")
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    body = {"name": "x", "machine_type": str(world.machine_type.pk), "command": "true"}
    assert client.post("/api/v1/job-configs/", body, format="json").status_code == 403
    assert client.get("/api/v1/job-configs/").status_code == 200


def test_a_member_removed_from_the_org_loses_access(world: World) -> None:
    world.org.memberships.filter(user=world.users["member"]).delete()
    response = world.client("member").get("/api/v1/events/")
    assert response.status_code == 403


def test_lists_are_paginated_filtered_and_ordered(world: World) -> None:
    for i in range(7):
        event_record(kind="pool.created" if i % 2 else "job.queued", org=world.org, actor="t", n=i)
    client = world.client("viewer")
    page = client.get("/api/v1/events/?limit=3").json()
    assert set(page) == {"count", "next", "previous", "results"}
    assert len(page["results"]) == 3 and page["next"]
    assert [e["data"].get("n") for e in page["results"]] == [6, 5, 4]  # newest first
    pools = client.get("/api/v1/events/?kind_prefix=pool").json()
    assert pools["count"] == 3 and all(e["kind"].startswith("pool") for e in pools["results"])
    oldest = client.get("/api/v1/events/?ordering=id&kind_prefix=job").json()["results"]
    assert [e["data"]["n"] for e in oldest] == [0, 2, 4, 6]


def test_validation_errors_name_their_fields(world: World) -> None:
    client = world.client("admin")
    response = client.post(
        "/api/v1/job-configs/",
        {
            "name": "bad name!",
            "machine_type": str(world.machine_type.pk),
            "command": "x",
            "timeout_seconds": 0,
        },
        format="json",
    )
    assert response.status_code == 400
    body = response.json()
    assert body["code"] == "invalid"
    assert set(body["fields"]) == {"name", "timeout_seconds"}
    assert not JobConfiguration.objects.exists()


@pytest.mark.parametrize(
    ("env", "words"),
    [({"1BAD": "x"}, "not a valid variable name"), ({"CATACLOUD_ATTEMPT": "9"}, "reserved")],
)
def test_env_is_checked(world: World, env: dict, words: str) -> None:
    body = {"name": "e", "machine_type": str(world.machine_type.pk), "command": "x", "env": env}
    response = world.client("admin").post("/api/v1/job-configs/", body, format="json")
    assert response.status_code == 400
    assert words in response.json()["detail"]
    assert not JobConfiguration.objects.exists()


def test_privileged_resource_types_answer_403_missing_privilege(world: World) -> None:
    lab = Privilege.objects.create(name="lab")
    ResourceType.objects.create(id="lab-db", well="postgres_database", required_privilege=lab)
    body = {"name": "e", "machine_type": str(world.machine_type.pk), "command": "x", "resources": ["lab-db"]}
    response = world.client("admin").post("/api/v1/job-configs/", body, format="json")
    assert response.status_code == 403
    assert response.json()["code"] == "missing_privilege"
    assert not JobConfiguration.objects.exists()
    world.org.privileges.add(lab)
    response = world.client("admin").post("/api/v1/job-configs/", body, format="json")
    assert response.status_code == 201
    assert response.json()["resources"] == ["lab-db"]


def test_machine_types_carry_the_orgs_quota(world: World) -> None:
    rows = world.client("viewer").get("/api/v1/machine-types/").json()["results"]
    assert [r["name"] for r in rows] == ["small"]
    assert rows[0]["quota"]["max_pool_size"] == 10 and rows[0]["quota"]["max_instances"] == 20
    assert rows[0]["usable"] is True


def test_a_config_in_use_cannot_be_deleted(world: World) -> None:
    from apps.jobs.models import Job

    config = JobConfiguration.objects.create(
        org=world.org, name="b", machine_type=world.machine_type, command="x"
    )
    Job.objects.create(org=world.org, config=config, machine_type=world.machine_type, command="x")
    response = world.client("admin").delete(f"/api/v1/job-configs/{config.pk}/")
    assert response.status_code == 409 and response.json()["code"] == "in_use"
    assert JobConfiguration.objects.filter(pk=config.pk).exists()


def test_a_job_is_submitted_by_configuration_name_or_id_within_the_org(world: World) -> None:
    from apps.jobs.models import Job

    mine = JobConfiguration.objects.create(
        org=world.org, name="nightly", machine_type=world.machine_type, command="make"
    )
    theirs = JobConfiguration.objects.create(
        org=world.other_org, name="theirs", machine_type=world.machine_type, command="x"
    )
    member = world.client("member")
    by_name = member.post("/api/v1/jobs/", {"config": "nightly", "env": {"K": "v"}}, format="json")
    assert by_name.status_code == 201, by_name.content
    assert by_name.json()["config"] == str(mine.pk) and by_name.json()["config_name"] == "nightly"
    assert by_name.json()["env"] == {"K": "v"}
    by_id = member.post("/api/v1/jobs/", {"config": str(mine.pk)}, format="json")
    assert by_id.status_code == 201 and by_id.json()["config"] == str(mine.pk)
    # Unknown names, and another org's configuration by name or by id, are the same 400.
    for ref in ("no-such-config", "theirs", str(theirs.pk)):
        response = member.post("/api/v1/jobs/", {"config": ref}, format="json")
        assert response.status_code == 400, response.content
        assert response.json()["code"] == "unknown_config"
        assert response.json()["fields"] == {"config": ["does not exist"]}
    assert Job.objects.filter(org=world.org).count() == 2
    assert not Job.objects.filter(org=world.other_org).exists()


def test_a_retried_submit_with_its_idempotency_key_answers_the_first_job(world: World) -> None:
    from apps.events.models import Event
    from apps.jobs.models import Job

    JobConfiguration.objects.create(
        org=world.org, name="nightly", machine_type=world.machine_type, command="make"
    )
    JobConfiguration.objects.create(
        org=world.org, name="weekly", machine_type=world.machine_type, command="make"
    )
    member = world.client("member")
    key = {"HTTP_IDEMPOTENCY_KEY": "release-2026.11.27"}
    first = member.post("/api/v1/jobs/", {"config": "nightly"}, format="json", **key)
    assert first.status_code == 201, first.content
    again = member.post("/api/v1/jobs/", {"config": "nightly"}, format="json", **key)
    assert again.status_code == 200 and again["Idempotent-Replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    assert Job.objects.filter(org=world.org).count() == 1
    assert Event.objects.filter(kind="job.queued", org=world.org).count() == 1
    # the key named a submit of another configuration: refused, nothing queued
    other = member.post("/api/v1/jobs/", {"config": "weekly"}, format="json", **key)
    assert other.status_code == 409 and other.json()["code"] == "idempotency_key_reused"
    # without a key every submit queues; too long a key is refused before anything is written
    assert member.post("/api/v1/jobs/", {"config": "nightly"}, format="json").status_code == 201
    long = member.post("/api/v1/jobs/", {"config": "nightly"}, format="json", HTTP_IDEMPOTENCY_KEY="k" * 201)
    assert long.status_code == 400 and long.json()["fields"] == {
        "Idempotency-Key": ["at most 200 visible ASCII characters"]
    }
    assert Job.objects.filter(org=world.org).count() == 2


def test_a_database_that_does_not_answer_is_a_503_to_retry(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django.db import OperationalError

    from apps.machines.api import views

    def gone(**kwargs: object) -> None:
        raise OperationalError('connection failed: connection to server at "127.0.0.1", port 5432 failed')

    monkeypatch.setattr(views, "machine_types_for_org", gone)
    client = world.client("viewer")
    client.raise_request_exception = False
    response = client.get("/api/v1/machine-types/")
    assert response.status_code == 503 and response["Retry-After"] == "2"
    assert response.json()["code"] == "database_unavailable"

    def timed_out(**kwargs: object) -> None:  # the server answered: a bug to see, not to retry
        import psycopg

        error = OperationalError("canceling statement due to statement timeout")
        error.__cause__ = psycopg.errors.QueryCanceled("canceling statement due to statement timeout")
        raise error

    monkeypatch.setattr(views, "machine_types_for_org", timed_out)
    response = client.get("/api/v1/machine-types/")
    assert response.status_code == 500 and response.json()["code"] == "server_error"


def test_unknown_api_paths_and_crashes_answer_json(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    from apps.machines.api import views

    client = world.client("viewer")
    client.raise_request_exception = False
    response = client.get("/api/v1/no-such-thing/")
    assert response.status_code == 404 and response.json()["code"] == "not_found"

    def boom(**kwargs: object) -> None:
        raise RuntimeError("secret internals: password=hunter2")

    monkeypatch.setattr(views, "machine_types_for_org", boom)
    response = client.get("/api/v1/machine-types/")
    assert response.status_code == 500
    assert response.json() == {"code": "server_error", "detail": "internal error"}
    assert b"hunter2" not in response.content


def test_schema_and_docs_are_served(world: World) -> None:
    client = world.client("anonymous")
    schema = client.get("/api/v1/schema/?format=json")
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    assert "/api/v1/job-configs/" in paths and "/api/v1/events/" in paths
    assert "bearerAuth" in schema.json()["components"]["securitySchemes"]
    assert client.get("/api/docs/").status_code == 200


@pytest.mark.parametrize("page", ["/api/docs/", "/api/redoc/"])
def test_api_docs_load_only_our_own_assets_and_we_serve_them(
    world: World, page: str, tmp_path: Path, settings: Any
) -> None:
    """Swagger UI and ReDoc work offline: no CDN, no web fonts; every script, stylesheet and
    icon the page names is served by us (whitenoise from STATIC_ROOT after collectstatic, as
    `make dev` and compose do)."""
    from django.test import Client

    settings.STATIC_ROOT = str(tmp_path / "static")
    call_command("collectstatic", "--noinput", verbosity=0)
    client = Client()  # a new client: whitenoise indexes STATIC_ROOT when it starts
    html = client.get(page).content.decode()
    assets = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", html)
    assert any(a.endswith(".js") for a in assets), html
    assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", html, re.IGNORECASE), "an external URL"
    for url in assets:
        assert url.startswith("/static/drf_spectacular_sidecar/"), url
        response = client.get(url)
        assert response.status_code == 200, url
        assert b"".join(response.streaming_content if response.streaming else [response.content]), url
    spec = client.get(re.search(r"""(?:spec-url=|url:\s*)["']([^"']+)["']""", html).group(1) + "?format=json")
    assert spec.status_code == 200 and "/api/v1/jobs/" in spec.json()["paths"]


def test_metrics_count_requests(world: World) -> None:
    world.client("viewer").get("/api/v1/events/")
    with override_settings(CATACLOUD_METRICS_TOKEN="scrape"):
        body = world.client("anonymous").get("/metrics", HTTP_AUTHORIZATION="Bearer scrape").content.decode()
    assert 'catacloud_http_requests_total{method="GET",route="/api/v1/events/",status="200"}' in body


def test_values_the_database_cannot_take_are_a_400(world: World) -> None:
    """Found by schemathesis: a time zone offset PostgreSQL refuses (+19:08) was a 500."""
    response = world.client("viewer").get("/api/v1/events/?since=2030-06-04T15%3A47%3A58%2B19%3A08")
    assert response.status_code == 400
    assert response.json()["code"] == "invalid"
