"""Enrolled hosts over the API (issue 50, steps 1 and 5 and its Security section): an admin makes
an enrolment token (shown once, stored hashed, bounded), lists the organization's hosts with
their capacity and what runs there, cordons, drains, uncordons, revokes and prices them; the
operator's shared hosts are read only; another organization never sees or touches either.
The endpoint table (tests/api/endpoints.py) covers roles, outsiders and the schema as well."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.utils import timezone

from apps.core.crypto import hash_token
from apps.core.errors import Unauthenticated
from apps.events.models import Event
from apps.machines.hosts import host_enroll
from apps.machines.models import EnrolmentToken, Host, MachineInstance, MachineType, OrgMachineType
from catacloud.protocol import HostCapacity
from testkit.builders import instance_row, provider_account
from tests.api.endpoints import make_hosts
from tests.conftest import World

pytestmark = pytest.mark.django_db

CAPACITY = HostCapacity(cpus=4, memory_mb=8192, disk_gb=50, arch="aarch64")


def hosts_type() -> MachineType:
    return MachineType.objects.get(name="acme-hosts")


def written() -> tuple[Any, ...]:
    """What a refused write must leave as it was."""
    return (
        sorted(EnrolmentToken.objects.values_list("id", "revoked_at", "uses", "max_uses")),
        sorted(Host.objects.values_list("id", "status", "cordoned_at", "drain_deadline", "monthly_price")),
        sorted((str(h.pk), h.labels) for h in Host.objects.all()),
        sorted(MachineInstance.objects.values_list("id", "status")),
        Event.objects.count(),
    )


# ---- enrolment tokens -----------------------------------------------------------------------------


def test_an_admin_makes_an_enrolment_token_shown_once_and_stored_hashed(world: World) -> None:
    make_hosts(world)
    admin = world.client("admin")
    response = admin.post(
        "/api/v1/enrolment-tokens/",
        {
            "labels": {"gpu": "a4000", "site": "fsn1"},
            "max_uses": 2,
            "ttl_seconds": 3600,
            "description": "rack",
        },
        format="json",
    )
    assert response.status_code == 201, response.content
    body = response.json()
    secret = body["token"]
    assert secret.startswith("ce_") and len(secret) > 40
    assert body["prefix"] == secret[:10] and body["state"] == "active" and body["uses"] == 0
    assert body["provider_account"] == "hosts" and body["labels"] == {"gpu": "a4000", "site": "fsn1"}
    stored = EnrolmentToken.objects.get(pk=body["id"])
    assert stored.token_hash == hash_token(secret) and stored.org == world.org
    assert secret not in {stored.prefix, stored.token_hash, stored.description}
    assert timedelta(minutes=59) < stored.expires_at - timezone.now() <= timedelta(hours=1)
    # never shown again: not in the list, not in the detail
    listed = admin.get("/api/v1/enrolment-tokens/").json()["results"]
    assert body["id"] in [t["id"] for t in listed] and all("token" not in t for t in listed)
    detail = world.client("viewer").get(f"/api/v1/enrolment-tokens/{body['id']}/").json()
    assert "token" not in detail and secret not in str(detail)
    event = Event.objects.get(kind="enrolment_token.created", data__token=body["id"])
    assert event.actor.startswith("user:admin token:") and secret not in str(event.data)

    # Two hosts enroll with it, the third is refused; its hosts are acme's, with its labels.
    for name in ("gpu-1", "gpu-2"):
        host, _ = host_enroll(enrolment_token=secret, hostname=name, capacity=CAPACITY)
        assert host.org == world.org and host.labels == {"arch": "aarch64", "gpu": "a4000", "site": "fsn1"}
    with pytest.raises(Unauthenticated):
        host_enroll(enrolment_token=secret, hostname="gpu-3", capacity=CAPACITY)
    shown = admin.get(f"/api/v1/enrolment-tokens/{body['id']}/").json()
    assert (shown["uses"], shown["state"]) == (2, "used_up")


def test_a_revoked_token_enrolls_no_host_and_its_hosts_stay(world: World) -> None:
    make_hosts(world)
    admin = world.client("admin")
    made = admin.post("/api/v1/enrolment-tokens/", {"max_uses": 5}, format="json").json()
    host, _ = host_enroll(enrolment_token=made["token"], hostname="kept", capacity=CAPACITY)
    response = admin.post(f"/api/v1/enrolment-tokens/{made['id']}/revoke/")
    assert response.status_code == 200 and response.json()["state"] == "revoked"
    assert response.json()["revoked"] is True
    with pytest.raises(Unauthenticated):
        host_enroll(enrolment_token=made["token"], hostname="late", capacity=CAPACITY)
    host.refresh_from_db()
    assert host.status == "active"
    # a repeat answers the same, and records nothing more
    assert admin.post(f"/api/v1/enrolment-tokens/{made['id']}/revoke/").json()["state"] == "revoked"
    assert Event.objects.filter(kind="enrolment_token.revoked", data__token=made["id"]).count() == 1
    # by default the list holds every token; ?revoked=false the live ones
    live = admin.get("/api/v1/enrolment-tokens/?revoked=false").json()["results"]
    assert made["id"] not in [t["id"] for t in live]


def test_a_token_needs_an_account_of_enrolled_hosts_granted_to_the_organization(world: World) -> None:
    make_hosts(world)
    provider_account("hosts", "hosts-elsewhere", {})  # of kind hosts, no grant to acme
    admin = world.client("admin")
    before = written()

    local = admin.post("/api/v1/enrolment-tokens/", {"provider_account": "local"}, format="json")
    assert local.status_code == 400 and local.json()["code"] == "invalid"
    assert local.json()["fields"]["provider_account"] == [
        "provider account local is not for enrolled hosts (its kind is local); accounts of enrolled "
        "hosts it may use: hosts"
    ]
    other = admin.post("/api/v1/enrolment-tokens/", {"provider_account": "hosts-elsewhere"}, format="json")
    assert other.status_code == 400
    assert other.json()["fields"]["provider_account"] == [
        "no grant for a machine type on provider account hosts-elsewhere in organization acme "
        "(accounts of enrolled hosts it may use: hosts)"
    ]
    for body, field in [
        ({"labels": ["gpu"]}, "labels"),
        ({"labels": {"": "x"}}, "labels"),
        ({"labels": {"k": "v" * 64}}, "labels"),
        ({"labels": {f"k{i}": "v" for i in range(33)}}, "labels"),
        ({"labels": {"a\u0000": "b"}}, "labels"),
        ({"max_uses": 0}, "max_uses"),
        ({"max_uses": 10_001}, "max_uses"),
        ({"ttl_seconds": 10}, "ttl_seconds"),
        ({"token": "ce_mine"}, "token"),
        ({"org": "rival"}, "org"),
    ]:
        response = admin.post("/api/v1/enrolment-tokens/", body, format="json")
        assert response.status_code == 400, (body, response.content)
        assert response.json()["code"] == "invalid" and field in response.json()["fields"], body
    assert written() == before

    # Two accounts of enrolled hosts granted: the token must name one.
    second = provider_account("hosts", "hosts-2", {})
    OrgMachineType.objects.create(
        org=world.org,
        machine_type=MachineType.objects.create(
            name="second-hosts", provider_account=second, server_type="slot", cpus=1, memory_mb=512
        ),
    )
    unnamed = admin.post("/api/v1/enrolment-tokens/", {}, format="json")
    assert unnamed.status_code == 400
    assert unnamed.json()["fields"]["provider_account"] == [
        "name the provider account of enrolled hosts (usable: hosts, hosts-2)"
    ]
    named = admin.post("/api/v1/enrolment-tokens/", {"provider_account": str(second.pk)}, format="json")
    assert named.status_code == 201 and named.json()["provider_account"] == "hosts-2"


def test_a_viewer_and_a_member_read_tokens_but_make_none(world: World) -> None:
    make_hosts(world)
    before = written()
    for who in ("viewer", "member"):
        response = world.client(who).post("/api/v1/enrolment-tokens/", {}, format="json")
        assert response.status_code == 403 and response.json()["code"] == "permission_denied"
        assert "this needs the admin role" in response.json()["detail"]
        assert world.client(who).get("/api/v1/enrolment-tokens/").json()["count"] == 1
    assert written() == before


def test_the_operators_shared_tokens_are_not_listed_to_organizations(world: World) -> None:
    make_hosts(world)  # one of acme's, one shared
    listed = world.client("admin").get("/api/v1/enrolment-tokens/").json()["results"]
    assert [t["labels"] for t in listed] == [{"site": "fsn1"}]
    shared = EnrolmentToken.objects.get(org__isnull=True)
    response = world.client("admin").post(f"/api/v1/enrolment-tokens/{shared.pk}/revoke/")
    assert response.status_code == 404
    shared.refresh_from_db()
    assert shared.revoked_at is None


# ---- hosts ----------------------------------------------------------------------------------------


def test_hosts_show_capacity_what_their_slots_take_and_whose_they_are(world: World) -> None:
    _, own, shared = make_hosts(world)
    mt = hosts_type()
    instance_row(world.org, mt, status="claimed", host=own)
    instance_row(world.org, mt, status="ready", host=own)
    instance_row(world.org, mt, status="terminated", host=own)  # ended: takes nothing
    rows = {h["name"]: h for h in world.client("viewer").get("/api/v1/hosts/").json()["results"]}
    assert list(rows) == ["rack-1", "rack-1-shared"]
    host = rows["rack-1"]
    assert (host["org"], host["shared"], host["status"]) == ("acme", False, "active")
    assert host["capacity"] == {"cpus": 8, "memory_mb": 16384, "disk_gb": 100, "gpus": 0, "arch": "x86_64"}
    assert host["used"] == {"cpus": 2, "memory_mb": 2048, "disk_gb": 0, "gpus": 0, "slots": 2}
    assert host["labels"] == {"arch": "x86_64", "site": "fsn1"} and host["provider_account"] == "hosts"
    assert (host["cordoned"], host["draining"], host["monthly_price"]) == (False, False, None)
    assert host["last_seen_at"] and "agent_token_hash" not in host and "running" not in host
    assert (rows["rack-1-shared"]["org"], rows["rack-1-shared"]["shared"]) == (None, True)
    assert rows["rack-1-shared"]["used"]["slots"] == 0
    client = world.client("viewer")
    assert [h["name"] for h in client.get("/api/v1/hosts/?shared=true").json()["results"]] == [
        "rack-1-shared"
    ]
    assert client.get("/api/v1/hosts/?status=lost").json()["count"] == 0
    assert client.get(f"/api/v1/hosts/{own.pk}/").json()["used"]["slots"] == 2
    assert client.get(f"/api/v1/hosts/?id_prefix={str(shared.pk)[:8]}").json()["count"] == 1


def test_another_organization_never_sees_a_host_unless_the_operator_shares_it(world: World) -> None:
    _, own, shared = make_hosts(world)
    outsider = world.client("outsider")
    assert outsider.get("/api/v1/hosts/").json()["count"] == 0
    assert outsider.get(f"/api/v1/hosts/{own.pk}/").status_code == 404
    assert outsider.get(f"/api/v1/hosts/{shared.pk}/").status_code == 404
    # Granted a machine type of the hosts' account, rival sees the shared host, never acme's.
    OrgMachineType.objects.create(org=world.other_org, machine_type=hosts_type())
    listed = [h["id"] for h in outsider.get("/api/v1/hosts/").json()["results"]]
    assert listed == [str(shared.pk)]
    before = written()
    for path in ("cordon/", "uncordon/", "revoke/"):
        assert outsider.post(f"/api/v1/hosts/{own.pk}/{path}").status_code == 404
    assert (
        outsider.patch(f"/api/v1/hosts/{own.pk}/", {"monthly_price": "1"}, format="json").status_code == 404
    )
    assert written() == before


def test_a_shared_host_is_read_only_to_organizations(world: World) -> None:
    _, _, shared = make_hosts(world)
    admin = world.client("admin")
    before = written()
    for method, path, body in [
        ("post", "cordon/", {"drain_seconds": 60}),
        ("post", "uncordon/", {}),
        ("post", "revoke/", {}),
        ("patch", "", {"monthly_price": "10"}),
    ]:
        response = getattr(admin, method)(f"/api/v1/hosts/{shared.pk}/{path}", body, format="json")
        assert response.status_code == 403, (path, response.content)
        assert response.json()["code"] == "shared_host"
        assert response.json()["detail"] == (
            "host rack-1-shared is shared by the operator (it runs every granted organization's jobs): "
            "only the operator manages it, in the console"
        )
    assert written() == before


def test_cordon_drain_uncordon_and_revoke_a_host(world: World) -> None:
    _, host, _ = make_hosts(world)
    mt = hosts_type()
    busy = instance_row(world.org, mt, status="claimed", host=host)
    idle = instance_row(world.org, mt, status="ready", host=host)
    admin = world.client("admin")
    url = f"/api/v1/hosts/{host.pk}/"

    cordoned = admin.post(f"{url}cordon/", {}, format="json").json()
    assert (cordoned["cordoned"], cordoned["draining"], cordoned["drain_deadline"]) == (True, False, None)
    busy.refresh_from_db()
    idle.refresh_from_db()
    assert (busy.status, idle.status) == ("claimed", "terminating")  # its job finishes; the idle one ends
    assert cordoned["used"]["slots"] == 2  # the ending one still holds its room until it is gone

    drained = admin.post(f"{url}cordon/", {"drain_seconds": 600}, format="json").json()
    assert drained["draining"] is True
    deadline = Host.objects.get(pk=host.pk).drain_deadline
    assert deadline is not None and timedelta(seconds=590) < deadline - timezone.now() <= timedelta(
        seconds=600
    )
    busy.refresh_from_db()
    assert busy.status == "claimed"  # until the deadline

    back = admin.post(f"{url}uncordon/").json()
    assert (back["cordoned"], back["draining"], back["drain_deadline"]) == (False, False, None)

    revoked = admin.post(f"{url}revoke/").json()
    assert revoked["status"] == "revoked"
    busy.refresh_from_db()
    assert busy.status == "terminating"  # its job is requeued elsewhere
    again = admin.post(f"{url}uncordon/")
    assert again.status_code == 409 and again.json()["code"] == "invalid_state"
    assert admin.post(f"{url}cordon/", {}, format="json").status_code == 409
    kinds = list(Event.objects.filter(kind__startswith="host.").order_by("id").values_list("kind", "actor"))
    assert [k for k, _ in kinds if k != "host.enrolled"] == [
        "host.cordoned",
        "host.draining",
        "host.uncordoned",
        "host.revoked",
    ]
    assert all(actor.startswith("user:admin token:") for k, actor in kinds if k != "host.enrolled")


def test_a_drain_of_zero_seconds_requeues_at_once_and_bad_deadlines_are_refused(world: World) -> None:
    _, host, _ = make_hosts(world)
    busy = instance_row(world.org, hosts_type(), status="claimed", host=host)
    admin = world.client("admin")
    before = written()
    for body in ({"drain_seconds": -1}, {"drain_seconds": "soon"}, {"drain_seconds": 31 * 86400}, {"x": 1}):
        response = admin.post(f"/api/v1/hosts/{host.pk}/cordon/", body, format="json")
        assert response.status_code == 400 and response.json()["code"] == "invalid", body
    assert written() == before
    assert (
        admin.post(f"/api/v1/hosts/{host.pk}/cordon/", {"drain_seconds": 0}, format="json").status_code == 200
    )
    busy.refresh_from_db()
    assert busy.status == "terminating"


def test_an_admin_prices_and_labels_a_host_and_bad_values_change_nothing(world: World) -> None:
    _, host, _ = make_hosts(world)
    admin = world.client("admin")
    url = f"/api/v1/hosts/{host.pk}/"
    changed = admin.patch(
        url, {"monthly_price": "99.50", "labels": {"site": "fsn1", "gpu": "a4000"}}, format="json"
    )
    assert changed.status_code == 200, changed.content
    assert changed.json()["monthly_price"] == "99.50" and changed.json()["labels"] == {
        "site": "fsn1",
        "gpu": "a4000",
    }
    host.refresh_from_db()
    assert host.monthly_price == Decimal("99.50")
    event = Event.objects.get(kind="host.updated")
    assert event.data["monthly_price"] == "99.50" and event.actor.startswith("user:admin")
    before = written()
    for body in (
        {"monthly_price": "-1"},
        {"monthly_price": "cheap"},
        {"monthly_price": "123456789012.00"},
        {"labels": "gpu"},
        {"labels": {"k" * 64: "v"}},
        {"labels": {"nul\u0000": "v"}},
        {"name": "renamed"},
        {"status": "active"},
    ):
        response = admin.patch(url, body, format="json")
        assert response.status_code == 400 and response.json()["code"] == "invalid", body
    assert written() == before
    cleared = admin.patch(url, {"monthly_price": None}, format="json").json()
    assert cleared["monthly_price"] is None
    assert admin.put(url, {"monthly_price": "1"}, format="json").status_code == 405
