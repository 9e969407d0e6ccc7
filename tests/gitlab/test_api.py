"""The GitLab connection and runner classes through the API, the catalog and the console: the
token and the secret token write-only and never shown, encrypted at rest, admins only, tenancy;
the CI jobs list."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from apps.control.catalog import CatalogError, apply_catalog
from apps.events.models import Event
from apps.gitlab.models import GitLabConnection, GitLabProject, GitLabRunnerClass
from tests.conftest import World
from tests.gitlab.conftest import APP, SECRET, TAGS, TOKEN, GitLabWorld, deliver, job_event

pytestmark = pytest.mark.django_db
BODY = {"token": TOKEN, "webhook_token": SECRET, "projects": [{"id": APP, "path": "acme/app"}]}


def _put(world: World, who: str, body: dict[str, Any]) -> Any:
    return world.client(who).put("/api/v1/gitlab/connection/", body, format="json")


def test_the_connection_is_admin_only_and_its_secrets_are_never_answered(world: World) -> None:
    assert _put(world, "member", BODY).status_code == 403
    assert world.client("viewer").get("/api/v1/gitlab/connection/").status_code == 404
    created = _put(world, "admin", {**BODY, "url": "https://gitlab.example.com/"})
    assert created.status_code == 201, created.content
    for who in ("admin", "viewer"):
        answer = world.client(who).get("/api/v1/gitlab/connection/")
        text = answer.content.decode()
        assert answer.status_code == 200 and SECRET not in text and TOKEN not in text
        data = answer.json()
        assert data["token_set"] and data["webhook_token_set"] and data["url"] == "https://gitlab.example.com"
        assert data["webhook_url"].endswith("/api/integrations/gitlab/webhook")
        assert data["projects"] == [{"id": APP, "path": "acme/app"}] and data["health"]["available"]
    stored = GitLabConnection.objects.get()
    assert SECRET not in stored.secrets_encrypted and TOKEN not in stored.secrets_encrypted  # encrypted
    events = json.dumps(list(Event.objects.filter(kind__startswith="gitlab.").values_list("data", flat=True)))
    assert SECRET not in events and TOKEN not in events and "webhook_token" in events  # named, never shown
    assert world.client("outsider").get("/api/v1/gitlab/connection/").status_code == 404
    again = _put(
        world, "admin", {"projects": [{"id": APP, "path": "acme/app"}, {"id": 13, "path": "acme/lib"}]}
    )
    assert again.status_code == 200 and GitLabConnection.objects.get().token == TOKEN  # kept
    assert GitLabProject.objects.count() == 2
    assert world.client("admin").delete("/api/v1/gitlab/connection/").status_code == 204
    assert not GitLabConnection.objects.exists()


def test_bad_connections_are_refused_with_nothing_written(world: World) -> None:
    cases = [
        ({"webhook_token": SECRET}, "token"),
        ({"token": TOKEN}, "webhook_token"),
        ({**BODY, "webhook_token": "short"}, "webhook_token"),
        ({**BODY, "token": "two words"}, "token"),
        ({**BODY, "url": "ftp://gitlab.example.com"}, "url"),
        ({**BODY, "projects": [{"id": 0, "path": "acme/app"}]}, "projects"),
        ({**BODY, "projects": [{"id": 5, "path": "no-namespace"}]}, "projects"),
    ]
    for body, field in cases:
        answer = _put(world, "admin", body)
        assert answer.status_code == 400 and field in answer.json()["fields"], (body, answer.content)
        assert TOKEN not in answer.content.decode() and "two words" not in answer.content.decode()
    assert not GitLabConnection.objects.exists()


def test_a_project_belongs_to_one_organization(gl: GitLabWorld) -> None:
    answer = _put(gl.world, "outsider", {**BODY, "url": gl.fake.url})
    assert answer.status_code == 409 and answer.json()["code"] == "in_use"
    assert not GitLabConnection.objects.filter(org=gl.world.other_org).exists()


def test_runner_classes_through_the_api(gl: GitLabWorld) -> None:
    admin = gl.world.client("admin")
    mt = str(gl.world.machine_type.pk)
    made = admin.post(
        "/api/v1/gitlab/runner-classes/",
        {
            "name": "big",
            "tags": ["catacloud", "Big"],
            "machine_type": mt,
            "priority": 5,
            "timeout_seconds": 1200,
        },
        format="json",
    )
    assert made.status_code == 201, made.content
    assert made.json()["tags"] == ["big", "catacloud"] and made.json()["executor"] == "shell"
    rc = GitLabRunnerClass.objects.get(name="big")
    config = rc.job_config
    assert (config.name, config.priority, config.reuse, config.timeout_seconds) == (
        "gitlab-big",
        5,
        "reuse",
        1200,
    )
    command = config.command
    assert "exec gitlab-runner run-single --config" in command and "--wait-timeout 300" in command
    refused = [
        ({"name": "g", "tags": ["x"], "machine_type": mt, "scope": "group"}, "group_id"),
        ({"name": "e", "tags": ["y"], "machine_type": mt, "executor": "kubernetes"}, "executor"),
        # its machine type gives jobs no container engine
        ({"name": "d", "tags": ["w"], "machine_type": mt, "executor": "docker"}, "executor"),
        ({"name": "i", "tags": ["z"], "machine_type": mt, "image": "not an image"}, "image"),
        ({"name": "t", "tags": [], "machine_type": mt}, "tags"),
    ]
    for body, field in refused:
        answer = admin.post("/api/v1/gitlab/runner-classes/", body, format="json")
        assert answer.status_code == 400 and field in answer.json().get("fields", {}), (body, answer.content)
    docker = admin.post(
        "/api/v1/gitlab/runner-classes/",
        {"name": "d", "tags": ["w"], "machine_type": mt, "executor": "docker"},
        format="json",
    )
    assert "containers: true" in docker.json()["fields"]["executor"][0], docker.content
    gl.world.machine_type.containers = True
    gl.world.machine_type.save(update_fields=["containers"])
    docker = admin.post(
        "/api/v1/gitlab/runner-classes/",
        {"name": "d", "tags": ["w"], "machine_type": mt, "executor": "docker"},
        format="json",
    )
    assert docker.status_code == 201, docker.content
    same = admin.post(
        "/api/v1/gitlab/runner-classes/",
        {"name": "twin", "tags": ["big", "catacloud"], "machine_type": mt},
        format="json",
    )
    assert same.status_code == 400 and same.json()["code"] == "duplicate_name"
    patched = admin.patch(
        f"/api/v1/gitlab/runner-classes/{rc.pk}/",
        {"runner_path": "/srv/gitlab-runner", "image": "registry.example.com/ci/runner:1"},
        format="json",
    )
    assert patched.status_code == 200, patched.content
    config.refresh_from_db()
    assert (
        "/srv/gitlab-runner run-single" in config.command
        and config.image == "registry.example.com/ci/runner:1"
    )
    assert (
        gl.world.client("member").post("/api/v1/gitlab/runner-classes/", {}, format="json").status_code == 403
    )
    assert gl.world.client("outsider").get(f"/api/v1/gitlab/runner-classes/{rc.pk}/").status_code == 404
    assert admin.delete(f"/api/v1/gitlab/runner-classes/{rc.pk}/").status_code == 204
    assert not GitLabRunnerClass.objects.filter(name="big").exists()


def test_the_jobs_seen_are_listed_per_organization(gl: GitLabWorld) -> None:
    deliver(job_event(1, "pending", tags=TAGS, pipeline="Nightly"))
    deliver(job_event(2, "pending", tags=["not-ours"]))
    listed = gl.world.client("viewer").get("/api/v1/gitlab/jobs/?gitlab_id=1").json()["results"]
    assert [(j["project"], j["pipeline"], j["status"], j["runner_class"]) for j in listed] == [
        ("acme/app", "Nightly", "pending", "small")
    ]
    assert gl.world.client("outsider").get("/api/v1/gitlab/jobs/").json()["results"] == []
    pending = gl.world.client("viewer").get(f"/api/v1/gitlab/runner-classes/{gl.runner_class.pk}/").json()
    assert pending["pending"] == 1


def test_the_catalog_applies_a_gitlab_section_idempotently(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token_file = tmp_path / "gitlab-token"
    token_file.write_text(TOKEN)
    monkeypatch.setenv("GL_HOOK_SECRET", SECRET)
    text = f"""
organizations:
  - slug: acme
    gitlab:
      url: https://gitlab.example.com
      token: {{file: {token_file}}}
      webhook_token: {{env: GL_HOOK_SECRET}}
      projects: [{{id: 12, path: acme/app}}]
      runner_classes:
        - name: small
          tags: [catacloud, linux-2cpu]
          machine_type: {world.machine_type.name}
          priority: 3
"""
    first = apply_catalog(text)
    assert "gitlab connection of acme" in first.created and "gitlab runner class acme/small" in first.created
    conn = GitLabConnection.objects.get()
    assert (conn.url, conn.token, conn.webhook_token) == ("https://gitlab.example.com", TOKEN, SECRET)
    assert GitLabRunnerClass.objects.get().tags == sorted(TAGS)
    assert not apply_catalog(text).changed
    with pytest.raises(CatalogError, match="must be a reference"):
        apply_catalog(text.replace(f"{{file: {token_file}}}", "glpat-inline"))


def test_the_console_pages_show_no_secret(gl: GitLabWorld, ops: Client) -> None:
    deliver(job_event(1, "pending", tags=TAGS))
    for url in (
        "/admin/gitlab/gitlabconnection/",
        f"/admin/gitlab/gitlabconnection/{gl.connection.pk}/change/",
        "/admin/gitlab/gitlabrunnerclass/",
        f"/admin/gitlab/gitlabrunnerclass/{gl.runner_class.pk}/change/",
        "/admin/gitlab/gitlabjob/",
        "/admin/gitlab/gitlabdelivery/",
        "/admin/gitlab/gitlabrunner/",
    ):
        page = ops.get(url)
        assert page.status_code == 200, url
        assert SECRET not in page.content.decode() and TOKEN not in page.content.decode()
