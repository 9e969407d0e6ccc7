"""Enrolled hosts, their tokens and their slots (apps.machines.hosts, hostops; the host's Agent
API in apps.control.agent.hosts), against real PostgreSQL and Redis."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from apps.core.errors import Unauthenticated, ValidationFailed
from apps.machines.hostops import host_cordon, host_revoke, hosts_lost
from apps.machines.hosts import NoHostRoom, enrolment_token_create, enrolment_token_revoke, host_enroll
from apps.machines.lifecycle import instance_request
from apps.machines.models import EnrolmentToken, Host, MachineInstance, MachineType, OrgMachineType
from catacloud.protocol import HostCapacity
from testkit.builders import granted_type, provider_account
from tests.concurrency import at_once
from tests.conftest import World

CAPACITY = HostCapacity(cpus=2, memory_mb=4096, disk_gb=100, arch="x86_64")


@pytest.fixture
def rack(world: World) -> tuple[Any, MachineType]:
    account = provider_account("hosts", "rack", {})
    mt, _ = granted_type(
        world.org, account, "on-rack", cpus=1, memory_mb=512, server_type="slot", price_per_hour=Decimal(0)
    )
    return account, mt


def enroll(account: Any, org: Any, **labels: str) -> tuple[Host, str]:
    _, token = enrolment_token_create(provider_account=account, org=org, labels=labels)
    return host_enroll(enrolment_token=token, hostname="box", capacity=CAPACITY)


def exchange(token: str, running: list[str] | None = None, wait: float = 0) -> Any:
    return Client().post(
        f"/api/agent/v1/hosts/exchange?wait={wait}",
        {"running": running or []},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Agent {token}",
    )


@pytest.mark.django_db
def test_an_enrolment_token_is_shown_once_stored_hashed_and_bounded(world: World, rack: Any) -> None:
    account, _ = rack
    row, token = enrolment_token_create(provider_account=account, org=world.org, labels={"gpu": "a4000"})
    assert token.startswith("ce_") and token not in str(
        EnrolmentToken.objects.filter(pk=row.pk).values().get()
    )
    host, secret = host_enroll(enrolment_token=token, hostname="box", capacity=CAPACITY)
    assert host.org_id == world.org.pk and host.labels == {"arch": "x86_64", "gpu": "a4000"}
    assert secret.startswith("ch_") and secret not in str(Host.objects.filter(pk=host.pk).values().get())
    with pytest.raises(Unauthenticated) as used:  # single-use
        host_enroll(enrolment_token=token, hostname="again", capacity=CAPACITY)
    assert used.value.code == "invalid_enrolment_token"
    many, token = enrolment_token_create(provider_account=account, org=None, max_uses=2, ttl_seconds=60)
    host_enroll(enrolment_token=token, hostname="one", capacity=CAPACITY)
    enrolment_token_revoke(token_id=many.pk)
    with pytest.raises(Unauthenticated):
        host_enroll(enrolment_token=token, hostname="two", capacity=CAPACITY)
    expired, token = enrolment_token_create(provider_account=account, org=None)
    EnrolmentToken.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    with pytest.raises(Unauthenticated):
        host_enroll(enrolment_token=token, hostname="late", capacity=CAPACITY)
    assert Host.objects.count() == 2


@pytest.mark.django_db
def test_bad_tokens_and_reports_get_a_4xx_with_a_code_and_write_nothing(world: World, rack: Any) -> None:
    account, _ = rack
    with pytest.raises(ValidationFailed):  # not a hosts account
        enrolment_token_create(provider_account=world.account, org=world.org)
    with pytest.raises(ValidationFailed):
        enrolment_token_create(provider_account=account, org=world.org, labels={"k": {"nested": 1}})
    refused = Client().post(
        "/api/agent/v1/hosts/enroll",
        {"enrolment_token": "ce_forged", "hostname": "x", "capacity": {"cpus": 1, "memory_mb": 1}},
        content_type="application/json",
    )
    assert refused.status_code == 401 and refused.json()["code"] == "invalid_enrolment_token"
    malformed = Client().post(
        "/api/agent/v1/hosts/enroll",
        {"enrolment_token": "ce_x", "hostname": "x", "capacity": {"cpus": "many"}},
        content_type="application/json",
    )
    assert malformed.status_code == 400 and malformed.json()["code"]
    _, secret = enroll(account, world.org)
    assert exchange(secret, running=[{"not": "an id"}]).status_code == 400  # type: ignore[list-item]
    assert exchange("ch_unknown").status_code == 401
    assert exchange("ca_a_machines_token").json()["code"] == "authentication_failed"
    assert Host.objects.count() == 1 and EnrolmentToken.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_slots_requested_at_once_never_fill_a_host_past_its_capacity(tworld: World) -> None:
    account = provider_account("hosts", "rack", {})
    mt, _ = granted_type(tworld.org, account, "on-rack", cpus=1, memory_mb=512, server_type="slot")
    enroll(account, tworld.org)  # 2 cpus: two slots of one cpu
    outcomes: list[str] = []

    def request() -> None:
        try:
            instance_request(org=tworld.org.pk, machine_type=MachineType.objects.get(pk=mt.pk))
            outcomes.append("slot")
        except NoHostRoom:
            outcomes.append("no room")

    at_once(8, request)
    assert sorted(outcomes) == ["no room"] * 6 + ["slot"] * 2
    assert MachineInstance.objects.filter(machine_type=mt, host__isnull=False).count() == 2


@pytest.mark.django_db
def test_the_exchange_says_which_slots_to_start_and_stop_until_the_host_reports_it_done(
    world: World, rack: Any
) -> None:
    account, mt = rack
    host, secret = enroll(account, world.org)
    slot = instance_request(org=world.org, machine_type=mt)
    assert slot.host_id == host.pk
    MachineInstance.objects.filter(pk=slot.pk).update(status="provisioning")
    answer = exchange(secret).json()
    (start,) = answer["start"]
    assert start["instance_id"] == str(slot.pk) and (start["cpus"], start["memory_mb"]) == (1, 512)
    assert start["bootstrap_token"].startswith("cb.") and answer["stop"] == []
    assert exchange(secret, running=[str(slot.pk)]).json()["start"] == []  # started: said no more
    MachineInstance.objects.filter(pk=slot.pk).update(status="terminated")
    assert exchange(secret, running=[str(slot.pk), "not-ours"]).json()["stop"] == [str(slot.pk), "not-ours"]
    host.refresh_from_db()
    assert host.running == [str(slot.pk), "not-ours"] and host.last_seen_at is not None


@pytest.mark.django_db
def test_a_cordoned_lost_or_revoked_host_gets_no_slot_and_a_revoked_one_is_refused(
    world: World, rack: Any, settings: Any
) -> None:
    account, mt = rack
    host, secret = enroll(account, world.org)
    host_cordon(host_id=host.pk)
    with pytest.raises(NoHostRoom, match="none active and uncordoned"):
        instance_request(org=world.org, machine_type=mt)
    Host.objects.filter(pk=host.pk).update(cordoned_at=None, last_seen_at=timezone.now() - timedelta(hours=1))
    assert hosts_lost() == 1 and Host.objects.get(pk=host.pk).status == "lost"
    with pytest.raises(NoHostRoom):
        instance_request(org=world.org, machine_type=mt)
    assert exchange(secret).status_code == 200  # its agent is back: so is it
    assert Host.objects.get(pk=host.pk).status == "active"
    slot = instance_request(org=world.org, machine_type=mt)
    host_revoke(host_id=host.pk)
    assert MachineInstance.objects.get(pk=slot.pk).status == "terminating"
    assert exchange(secret).status_code == 401


@pytest.mark.django_db
def test_slots_go_only_to_hosts_of_the_org_or_shared_and_with_the_types_labels(world: World) -> None:
    account = provider_account("hosts", "rack", {})
    gpu, _ = granted_type(
        world.org, account, "gpu", cpus=1, memory_mb=512, server_type="slot", host_labels={"gpu": "a4000"}
    )
    OrgMachineType.objects.create(org=world.other_org, machine_type=gpu, max_instances=10)
    theirs, _ = enroll(account, world.other_org, gpu="a4000")
    plain, _ = enroll(account, world.org)
    with pytest.raises(NoHostRoom):  # theirs has the label but is another org's; ours lacks it
        instance_request(org=world.org, machine_type=gpu)
    shared, _ = enroll(account, None, gpu="a4000")
    assert {instance_request(org=world.org, machine_type=gpu).host_id for _ in range(2)} == {shared.pk}
    assert instance_request(org=world.other_org, machine_type=gpu).host_id in {theirs.pk, shared.pk}
    assert not MachineInstance.objects.filter(host=plain).exists()


@pytest.mark.django_db
def test_an_ended_slot_its_host_still_runs_holds_its_room_until_the_host_stops_it(
    world: World, rack: Any
) -> None:
    account, mt = rack
    host, secret = enroll(account, world.org)  # 2 cpus
    slots = [instance_request(org=world.org, machine_type=mt) for _ in range(2)]
    MachineInstance.objects.filter(pk__in=[s.pk for s in slots]).update(status="terminated")
    exchange(secret, running=[str(s.pk) for s in slots])  # their sandboxes still run
    with pytest.raises(NoHostRoom):
        instance_request(org=world.org, machine_type=mt)
    exchange(secret, running=[])  # stopped
    assert instance_request(org=world.org, machine_type=mt).host_id == host.pk


@pytest.mark.django_db
def test_a_slot_busy_when_its_host_was_cordoned_is_not_kept_for_another_job(world: World, rack: Any) -> None:
    """A cordon ends the idle slots; a busy one ends after its job instead of going back to
    ready (reuse), and the reaper ends any ready slot a cordoned host still has."""
    from apps.jobs.reports import instance_release
    from apps.machines.hostops import host_drain_due
    from testkit.builders import job_config, job_row

    account, mt = rack
    host, _ = enroll(account, world.org)
    busy, idle = (instance_request(org=world.org, machine_type=mt) for _ in range(2))
    MachineInstance.objects.filter(pk=idle.pk).update(status="ready")
    job = job_row(job_config(world.org, mt, "r", "true", reuse="reuse"), status="running", instance=busy)
    MachineInstance.objects.filter(pk=busy.pk).update(status="claimed", claimed_for=f"job:{job.pk}")
    host_cordon(host_id=host.pk)
    assert MachineInstance.objects.get(pk=idle.pk).status == "terminating"
    instance_release(instance_id=busy.pk, job=job)
    assert MachineInstance.objects.get(pk=busy.pk).status == "terminating"  # not ready for the next
    MachineInstance.objects.filter(pk=busy.pk).update(status="ready")  # one that slipped through
    assert host_drain_due() == 1 and MachineInstance.objects.get(pk=busy.pk).status == "terminating"
