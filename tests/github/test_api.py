"""The connection and runner classes through the API, the catalog and the console: secrets
write-only and never shown, admins only, tenancy; and the one GitHub client's discipline
(token cached until shortly before expiry, rate limits honoured, outages hold jobs)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from apps.control.catalog import CatalogError, apply_catalog
from apps.events.models import Event
from apps.github.client import GitHubClient, GitHubRateLimited, GitHubUnavailable
from apps.github.models import GitHubConnection, GitHubInstallation, RunnerClass
from tests.conftest import World
from tests.github.conftest import LABELS, SECRET, GitHubWorld

pytestmark = pytest.mark.django_db


def _put(world: World, who: str, body: dict[str, Any]) -> Any:
    return world.client(who).put("/api/v1/github/connection/", body, format="json")


def test_the_connection_is_admin_only_and_its_secrets_are_never_answered(world: World, app_key: Any) -> None:
    body = {"app_id": 7, "private_key": app_key[0], "webhook_secret": SECRET, "installations": [{"id": 42}]}
    assert _put(world, "member", body).status_code == 403
    assert world.client("viewer").get("/api/v1/github/connection/").status_code == 404
    created = _put(world, "admin", body)
    assert created.status_code == 201, created.content
    for who in ("admin", "viewer"):
        answer = world.client(who).get("/api/v1/github/connection/")
        text = answer.content.decode()
        assert answer.status_code == 200 and SECRET not in text and "PRIVATE KEY" not in text
        assert answer.json()["private_key_set"] and answer.json()["webhook_secret_set"]
        assert answer.json()["webhook_url"].endswith("/api/integrations/github/webhook")
    stored = GitHubConnection.objects.get()
    assert SECRET not in stored.secrets_encrypted and "PRIVATE" not in stored.secrets_encrypted  # encrypted
    events = json.dumps(list(Event.objects.filter(kind__startswith="github.").values_list("data", flat=True)))
    assert SECRET not in events and "webhook_secret" in events  # named, never shown
    # another org sees nothing of it
    assert world.client("outsider").get("/api/v1/github/connection/").status_code == 404
    # a change without secrets keeps them
    again = _put(world, "admin", {"api_url": "https://ghe.example.com/api/v3"})
    assert again.status_code == 200 and GitHubConnection.objects.get().webhook_secret == SECRET


def test_bad_connections_are_refused_with_nothing_written(world: World, app_key: Any) -> None:
    cases = [
        ({"app_id": 7, "webhook_secret": SECRET}, "private_key"),
        ({"app_id": 7, "private_key": "not a key", "webhook_secret": SECRET}, "private_key"),
        ({"app_id": 7, "private_key": app_key[0], "webhook_secret": "short"}, "webhook_secret"),
        (
            {"app_id": 7, "private_key": app_key[0], "webhook_secret": SECRET, "installations": [{"id": 0}]},
            "installations",
        ),
    ]
    for body, field in cases:
        answer = _put(world, "admin", body)
        assert answer.status_code == 400 and field in answer.json()["fields"], (body, answer.content)
        assert "not a key" not in answer.content.decode()
    assert not GitHubConnection.objects.exists()


def test_an_installation_belongs_to_one_organization(gh: GitHubWorld, app_key: Any) -> None:
    body = {
        "app_id": 7,
        "private_key": app_key[0],
        "webhook_secret": SECRET,
        "installations": [{"id": 42}],
        "api_url": gh.fake.url,
    }
    answer = _put(gh.world, "outsider", body)
    assert answer.status_code == 409 and answer.json()["code"] == "in_use"
    assert not GitHubConnection.objects.filter(org=gh.world.other_org).exists()


def test_runner_classes_through_the_api(gh: GitHubWorld) -> None:
    admin = gh.world.client("admin")
    mt = str(gh.world.machine_type.pk)
    made = admin.post(
        "/api/v1/github/runner-classes/",
        {"name": "big", "labels": ["self-hosted", "catacloud-big"], "machine_type": mt, "priority": 5},
        format="json",
    )
    assert made.status_code == 201, made.content
    rc = RunnerClass.objects.get(name="big")
    assert (
        rc.job_config.name == "github-big" and rc.job_config.priority == 5 and rc.job_config.reuse == "reuse"
    )
    assert "exec ./run.sh" in rc.job_config.command and "/opt/actions-runner" in rc.job_config.command
    generic = admin.post(
        "/api/v1/github/runner-classes/",
        {"name": "g", "labels": ["self-hosted", "linux"], "machine_type": mt},
        format="json",
    )
    assert generic.status_code == 400 and "labels" in generic.json()["fields"]
    same = admin.post(
        "/api/v1/github/runner-classes/",
        {"name": "twin", "labels": ["catacloud-big", "self-hosted"], "machine_type": mt},
        format="json",
    )
    assert same.status_code == 400 and same.json()["code"] == "duplicate_name"
    patched = admin.patch(
        f"/api/v1/github/runner-classes/{rc.pk}/", {"runner_dir": "/srv/runner"}, format="json"
    )
    assert (
        patched.status_code == 200 and "/srv/runner" in RunnerClass.objects.get(pk=rc.pk).job_config.command
    )
    assert (
        gh.world.client("member").post("/api/v1/github/runner-classes/", {}, format="json").status_code == 403
    )
    assert gh.world.client("outsider").get(f"/api/v1/github/runner-classes/{rc.pk}/").status_code == 404
    assert admin.delete(f"/api/v1/github/runner-classes/{rc.pk}/").status_code == 204
    assert not RunnerClass.objects.filter(name="big").exists()


def test_the_catalog_applies_a_github_section_idempotently(
    world: World, app_key: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    key_file = tmp_path / "app.pem"
    key_file.write_text(app_key[0])
    monkeypatch.setenv("GH_HOOK_SECRET", SECRET)
    text = f"""
organizations:
  - slug: acme
    github:
      app_id: 99
      private_key: {{file: {key_file}}}
      webhook_secret: {{env: GH_HOOK_SECRET}}
      installations: [{{id: 77, account: acme-gh}}]
      runner_classes:
        - name: small
          labels: [self-hosted, catacloud-linux-2cpu]
          machine_type: {world.machine_type.name}
          priority: 3
"""
    first = apply_catalog(text)
    assert "github connection of acme" in first.created and "runner class acme/small" in first.created
    conn = GitHubConnection.objects.get()
    assert (conn.app_id, conn.webhook_secret) == (99, SECRET)
    assert GitHubInstallation.objects.get().account == "acme-gh"
    assert RunnerClass.objects.get().labels == sorted(LABELS)
    second = apply_catalog(text)
    assert not second.changed
    with pytest.raises(CatalogError, match="must be a reference"):
        apply_catalog(text.replace(f"{{file: {key_file}}}", "'-----BEGIN PRIVATE KEY-----'"))


def test_the_console_pages_show_no_secret(gh: GitHubWorld, ops: Client) -> None:
    for url in (
        "/admin/github/githubconnection/",
        f"/admin/github/githubconnection/{gh.connection.pk}/change/",
        "/admin/github/runnerclass/",
        "/admin/github/workflowjob/",
        "/admin/github/webhookdelivery/",
    ):
        page = ops.get(url)
        assert page.status_code == 200, url
        assert SECRET not in page.content.decode() and "PRIVATE KEY" not in page.content.decode()


def test_the_installation_token_is_cached_until_shortly_before_it_expires(gh: GitHubWorld) -> None:
    client = GitHubClient(GitHubInstallation.objects.get())
    for _ in range(3):
        client.repositories()
    assert gh.fake.count("POST", "/app/installations/") == 1
    gh.fake.token_ttl = 200  # GitHub's tokens last an hour; this one is within the 5 minute margin
    GitHubInstallation.objects.update(token_expires_at=None)
    client = GitHubClient(GitHubInstallation.objects.get())
    client.repositories()
    client.repositories()
    assert gh.fake.count("POST", "/app/installations/") == 3  # refreshed each time: about to expire


def test_rate_limits_are_honoured_without_calling_again(gh: GitHubWorld) -> None:
    client = GitHubClient(GitHubInstallation.objects.get())
    client.repositories()
    gh.fake.rate_limit_for(30)
    with pytest.raises(GitHubRateLimited) as primary:
        client.repositories()
    assert 25 < primary.value.retry_after <= 32
    calls = gh.fake.api_calls()
    with pytest.raises(GitHubRateLimited):
        client.repositories()  # known limited: no call
    assert gh.fake.api_calls() == calls
    inst = GitHubInstallation.objects.get()
    assert not inst.is_available() and "rate limit" in inst.unavailable_reason
    assert Event.objects.filter(kind="github.unavailable").count() == 1


def test_a_secondary_limit_waits_for_retry_after_and_at_least_the_documented_minute(gh: GitHubWorld) -> None:
    client = GitHubClient(GitHubInstallation.objects.get())
    gh.fake.rate_limit_for(90, secondary=True)
    with pytest.raises(GitHubRateLimited) as limited:
        client.repositories()
    assert 89 <= limited.value.retry_after <= 92  # its retry-after
    # a while later (not in a row: the streak of secondary answers is kept in spend)
    GitHubInstallation.objects.update(unavailable_until=None, failures=0, spend={})
    gh.fake.rate_limit_for(5, secondary=True)
    with pytest.raises(GitHubRateLimited) as limited:
        client.repositories()
    assert limited.value.retry_after == 60  # "wait for at least one minute before retrying"


def test_server_errors_are_retried_then_make_the_installation_unavailable(gh: GitHubWorld) -> None:
    client = GitHubClient(GitHubInstallation.objects.get())
    client.repositories()
    gh.fake.fail_next("installation/repositories", 502, times=2)
    assert client.repositories() is not None  # two failures, the third try answers
    gh.fake.fail_next("installation/repositories", 503, times=3)
    started = time.monotonic()
    with pytest.raises(GitHubUnavailable):
        client.repositories()
    assert time.monotonic() - started < 3
    inst = GitHubInstallation.objects.get()
    assert not inst.is_available() and inst.failures == 1


def test_the_request_budget_keeps_a_reserve_for_dispatch(gh: GitHubWorld, settings: Any) -> None:
    settings.CATACLOUD_GITHUB_REQUEST_BUDGET = 10
    client = GitHubClient(GitHubInstallation.objects.get())
    client.repositories()  # token + call: 2 of 10
    GitHubInstallation.objects.update(window_calls=8)
    with pytest.raises(GitHubRateLimited, match="budget"):
        client.repositories()  # background: stops at 80 %
    client.runner_by_name(owner_path="/orgs/acme", name="x")  # dispatch: allowed up to 100 %
    GitHubInstallation.objects.update(window_calls=10)
    with pytest.raises(GitHubRateLimited, match="budget"):
        client.runner_by_name(owner_path="/orgs/acme", name="x")
