"""Organizations bring their own cloud: an organization admin adds a provider account (checked
with the provider before it is stored) and machine types on it that only that organization sees
and uses; its jobs are bought there, and its cost report says whose account paid. The real
``hcloud`` client against the fake Hetzner API (tests/fakes/hetzner_api.py) stands in for the
organization's cloud; services and task bodies are called directly (through a real worker:
tests/e2e/test_own_cloud.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings
from django.utils import timezone

from apps.control.services import grant_upsert
from apps.core.errors import ValidationFailed
from apps.core.selectors import installation_id
from apps.events.models import Event
from apps.jobs.scheduler import schedule
from apps.jobs.submission import job_submit
from apps.machines.models import MachineInstance, MachineType, ProviderAccount
from apps.machines.reconcile import reconcile_all
from apps.machines.services import machine_type_upsert
from apps.machines.tasks import provision_instance_task
from catacloud.providers import LABEL_INSTALLATION, LABEL_INSTANCE
from testkit.builders import job_config
from tests.conftest import HETZNER_TOKEN, World
from tests.fakes.hetzner_api import FakeHetzner

pytestmark = pytest.mark.django_db

ACCOUNT = {"name": "our-hetzner", "kind": "hetzner", "config": {"location": "fsn1"}}
TYPE = {"name": "own-cx23", "provider_account": "our-hetzner", "server_type": "cx23", "image": "ubuntu-24.04"}
SIZES = {"cpus": 2, "memory_mb": 4096, "price_per_hour": "0.0080", "billing_increment_seconds": 3600}


@pytest.fixture
def hetzner(fake_hetzner: FakeHetzner) -> Iterator[FakeHetzner]:
    """The organizations' Hetzner accounts call the fake API: the operator's setting, not theirs."""
    fake_hetzner.reset()
    operators = {"hetzner": {"api_endpoint": fake_hetzner.url, "retry_attempts": 0, "poll_interval": 0.05}}
    with override_settings(CATACLOUD_ORG_PROVIDER_SETTINGS=operators):
        yield fake_hetzner


def add_account(world: World, who: str = "admin", **body: Any) -> Any:
    payload = {**ACCOUNT, "credentials": {"token": HETZNER_TOKEN}, **body}
    return world.client(who).post("/api/v1/provider-accounts/", payload, format="json")


def add_type(world: World, who: str = "admin", **body: Any) -> Any:
    return world.client(who).post("/api/v1/machine-types/", {**TYPE, **SIZES, **body}, format="json")


def test_an_admin_adds_an_account_checked_with_the_provider_and_never_shown_again(
    world: World, hetzner: FakeHetzner
) -> None:
    answer = add_account(world)
    assert answer.status_code == 201, answer.content
    body = answer.json()
    assert (body["name"], body["kind"], body["config"]) == ("our-hetzner", "hetzner", {"location": "fsn1"})
    assert body["credential_keys"] == ["token"] and HETZNER_TOKEN not in answer.content.decode()
    assert hetzner.count("GET", "/servers") == 1  # the one cheap read call
    account = ProviderAccount.objects.get(pk=body["id"])
    assert account.org == world.org and account.credentials == {"token": HETZNER_TOKEN}
    assert HETZNER_TOKEN not in account.credentials_encrypted  # encrypted at rest
    listed = world.client("viewer").get("/api/v1/provider-accounts/").json()["results"]
    assert [a["name"] for a in listed] == ["our-hetzner"]  # the operator's local account is not listed
    assert Event.objects.filter(kind="provider_account.created", org=world.org).exists()


def test_credentials_the_provider_refuses_are_a_400_with_its_words_and_nothing_is_stored(
    world: World, hetzner: FakeHetzner
) -> None:
    answer = add_account(world, credentials={"token": "not-the-token"})
    assert answer.status_code == 400
    assert answer.json()["code"] == "provider_check_failed"
    assert "unable to authenticate" in answer.json()["detail"]  # the fake's (Hetzner's) message
    assert not ProviderAccount.objects.filter(org=world.org).exists()


@pytest.mark.parametrize(
    ("body", "status", "code", "says"),
    [
        ({"kind": "local"}, 400, "invalid", "hetzner, aws, azure"),
        ({"kind": "hosts"}, 400, "invalid", "hetzner, aws, azure"),
        (
            {"config": {"location": "fsn1", "api_endpoint": "http://169.254.169.254/"}},
            400,
            "invalid",
            "operator",
        ),
        ({"credentials": {}}, 400, "invalid", "credentials"),
        ({"config": {"network": "not-an-id"}}, 400, "provider_check_failed", "not-an-id"),
        ({"name": "no spaces"}, 400, "invalid", "name"),
    ],
)
def test_bad_accounts_are_refused_before_any_call(
    world: World, hetzner: FakeHetzner, body: dict, status: int, code: str, says: str
) -> None:
    answer = add_account(world, **body)
    assert (answer.status_code, answer.json()["code"]) == (status, code), answer.content
    assert says in answer.content.decode()
    assert hetzner.count("GET", "/servers") == 0
    assert not ProviderAccount.objects.filter(org=world.org).exists()


def test_the_operator_decides_which_kinds_organizations_may_bring(world: World, hetzner: FakeHetzner) -> None:
    with override_settings(CATACLOUD_ORG_PROVIDER_KINDS=["aws"]):
        answer = add_account(world)
    assert answer.status_code == 403
    assert answer.json()["code"] == "provider_kind_not_allowed" and "allowed: aws" in answer.json()["detail"]
    assert add_account(world, who="member").status_code == 403  # admins only
    assert not ProviderAccount.objects.filter(org=world.org).exists()


def test_an_own_machine_type_is_the_organizations_alone(world: World, hetzner: FakeHetzner) -> None:
    assert add_account(world).status_code == 201
    answer = add_type(world, limits={"max_instances": 3})
    assert answer.status_code == 201, answer.content
    mt = answer.json()
    assert (mt["own"], mt["provider_account"], mt["quota"]["max_instances"]) == (True, "our-hetzner", 3)
    names = [t["name"] for t in world.client("member").get("/api/v1/machine-types/").json()["results"]]
    assert names == ["own-cx23", "small"]

    rival = world.client("outsider")
    assert [t["name"] for t in rival.get("/api/v1/machine-types/").json()["results"]] == ["small"]
    account_id = ProviderAccount.objects.get(org=world.org).pk
    for path in (f"/api/v1/machine-types/{mt['id']}/", f"/api/v1/provider-accounts/{account_id}/"):
        assert rival.get(path).status_code == 404
        assert rival.patch(path, {"description": "mine"}, format="json").status_code == 404
        assert rival.delete(path).status_code == 404
    refused = rival.post(
        "/api/v1/job-configs/", {"name": "x", "command": "true", "machine_type": "own-cx23"}, format="json"
    )
    assert refused.status_code == 400 and "own-cx23" in refused.content.decode()
    # The rival may name a type of its own the same: names are per organization.
    with override_settings(CATACLOUD_ORG_PROVIDER_SETTINGS={"hetzner": {"api_endpoint": hetzner.url}}):
        assert add_account(world, who="outsider").status_code == 201
    assert add_type(world, who="outsider").status_code == 201
    assert MachineType.objects.filter(name="own-cx23").count() == 2


def test_names_an_organization_uses_stay_one_each(world: World, hetzner: FakeHetzner) -> None:
    add_account(world)
    clash = add_type(world, name="small")  # the operator's type granted to it
    assert (clash.status_code, clash.json()["code"]) == (400, "duplicate_name")
    assert add_type(world).status_code == 201
    # The operator's new type of the same name cannot be granted beside it.
    operator_type, _ = machine_type_upsert(
        name="own-cx23", provider_account=world.account, server_type="local", cpus=1, memory_mb=512
    )
    with pytest.raises(ValidationFailed, match="has a machine type of its own named own-cx23"):
        grant_upsert(org=world.org, machine_type=operator_type)
    # Nor is an own type granted to another organization.
    own = MachineType.objects.get(org=world.org)
    with pytest.raises(ValidationFailed, match="another organization's own"):
        grant_upsert(org=world.other_org, machine_type=own)


def test_the_operators_types_and_accounts_are_not_the_organizations_to_change(world: World) -> None:
    admin = world.client("admin")
    answer = admin.patch(f"/api/v1/machine-types/{world.machine_type.pk}/", {"cpus": 64}, format="json")
    assert (answer.status_code, answer.json()["code"]) == (403, "operators_own")
    assert admin.delete(f"/api/v1/machine-types/{world.machine_type.pk}/").status_code == 403
    assert admin.get(f"/api/v1/provider-accounts/{world.account.pk}/").status_code == 404
    world.machine_type.refresh_from_db()
    assert world.machine_type.cpus == 2


def test_an_own_type_changes_and_goes_only_when_nothing_uses_it(world: World, hetzner: FakeHetzner) -> None:
    add_account(world)
    mt = add_type(world).json()
    admin = world.client("admin")
    changed = admin.patch(
        f"/api/v1/machine-types/{mt['id']}/",
        {"server_type": "cx33", "limits": {"max_instances": 1}},
        format="json",
    )
    assert changed.status_code == 200, changed.content
    assert (
        changed.json()["server_type"],
        changed.json()["version"],
        changed.json()["quota"]["max_instances"],
    ) == ("cx33", 2, 1)
    job_config(world.org, MachineType.objects.get(pk=mt["id"]), "uses-it", "true")
    busy = admin.delete(f"/api/v1/machine-types/{mt['id']}/")
    assert (busy.status_code, busy.json()["code"]) == (409, "in_use")
    account = ProviderAccount.objects.get(org=world.org)
    held = admin.delete(f"/api/v1/provider-accounts/{account.pk}/")
    assert (held.status_code, held.json()["code"]) == (409, "in_use")


def test_its_jobs_are_bought_on_its_own_account_and_its_cost_report_says_who_paid(
    world: World, hetzner: FakeHetzner, tmp_path: Path
) -> None:
    (tmp_path / "catacloud_agent-0.1.0-py3-none-any.whl").write_bytes(b"an agent wheel")
    add_account(world)
    own = MachineType.objects.get(pk=add_type(world, limits={"max_instances": 5}).json()["id"])
    job_submit(org=world.org, config=job_config(world.org, own, "on-ours", "true"))
    schedule()
    machine = MachineInstance.objects.get(machine_type=own)
    assert machine.provider_account.org == world.org
    with override_settings(CATACLOUD_AGENT_WHEEL=str(tmp_path), CATACLOUD_PUBLIC_URL="http://127.0.0.1:1"):
        provision_instance_task.run(str(machine.pk))
    (server,) = hetzner.servers.values()
    assert server["labels"][LABEL_INSTANCE] == str(machine.pk)
    assert server["server_type"]["name"] == "cx23" and server["location"]["name"] == "fsn1"

    # An hour of the organization's machine and of the operator's: split by payer.
    start = timezone.now() - timedelta(hours=2)
    MachineInstance.objects.filter(pk=machine.pk).update(
        provisioning_started_at=start, ended_at=start + timedelta(minutes=30), status="terminated"
    )
    MachineInstance.objects.create(
        org=world.org,
        machine_type=world.machine_type,
        provider_account=world.account,
        status="terminated",
        provisioning_started_at=start,
        ended_at=start + timedelta(minutes=30),
    )
    report = world.client("viewer").get("/api/v1/costs/?group_by=payer").json()
    assert report["by_payer"] == {"operator": "0.010000", "organization": "0.008000"}
    assert {r["key"]: r["total"] for r in report["results"]} == {
        "operator": "0.010000",
        "organization": "0.008000",
    }
    assert Decimal(report["total"]) == Decimal("0.018")


def test_the_reconciler_ends_a_machine_of_ours_leaked_in_an_organizations_own_account(
    world: World, hetzner: FakeHetzner
) -> None:
    """Nothing paid is leaked in an organization's account either: a server carrying this
    installation's label and no live row is deleted; the organization's other servers are not."""
    add_account(world)
    add_type(world)
    ours = {LABEL_INSTALLATION: installation_id(), LABEL_INSTANCE: str(uuid.uuid4())}
    leaked = hetzner.add_server("cc-leaked", labels=ours)
    theirs = hetzner.add_server("their-database", labels={"team": "data"})
    reports = reconcile_all(grace_seconds=0)
    assert any(r.orphans_deleted for r in reports), reports
    assert leaked not in hetzner.servers or hetzner.servers[leaked]["status"] == "deleting"
    assert theirs in hetzner.servers


def test_a_revoked_token_cools_the_type_down_instead_of_a_refused_buy_every_tick(
    world: World, hetzner: FakeHetzner, tmp_path: Path
) -> None:
    """The organization revoked the token it gave: its cloud refuses every create. The machine
    fails with Hetzner's words, the type cools down (as after a capacity error) and nothing more
    is bought while the job waits, saying why: not one refused create per scheduler tick."""
    (tmp_path / "catacloud_agent-0.1.0-py3-none-any.whl").write_bytes(b"an agent wheel")
    add_account(world)
    own = MachineType.objects.get(pk=add_type(world).json()["id"])
    job = job_submit(org=world.org, config=job_config(world.org, own, "on-ours", "true"))
    hetzner.token = "rotated"  # the organization revoked the token Catacloud holds
    with override_settings(CATACLOUD_AGENT_WHEEL=str(tmp_path), CATACLOUD_PUBLIC_URL="http://127.0.0.1:1"):
        for _ in range(3):  # three scheduler ticks, each running what it enqueued
            schedule()
            for machine in MachineInstance.objects.filter(machine_type=own, status="pending"):
                provision_instance_task.run(str(machine.pk))
    (failed,) = MachineInstance.objects.filter(machine_type=own)
    assert failed.status == "failed" and failed.failure_reason.startswith("permanent:")
    assert "unable to authenticate" in failed.failure_reason
    own.refresh_from_db()
    assert own.capacity_cooling_until is not None and own.capacity_error.startswith("permanent:")
    assert Event.objects.filter(kind="machine_type.refused", data__machine_type="own-cx23").count() == 1
    assert hetzner.count("POST", "/servers") == 1
    job.refresh_from_db()
    assert job.pending_reason.startswith(
        "every candidate is cooling down after the provider's refusal: own-cx23"
    )
