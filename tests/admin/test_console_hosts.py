"""The console's enrolled hosts and enrolment tokens (issue 50, steps 1 and 5): what an operator
sees of each host (whose, capacity and use, slots, cordon or drain, last seen), the actions that
cordon, drain, uncordon and revoke through the services, and tokens made here shown once."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from decimal import Decimal

import pytest
from django.test import Client
from django.utils import timezone

from apps.core.crypto import hash_token
from apps.events.models import Event
from apps.machines.hosts import host_enroll
from apps.machines.models import EnrolmentToken, Host, MachineInstance, MachineType
from catacloud.protocol import HostCapacity
from testkit.builders import instance_row
from tests.admin.test_admin_actions import act
from tests.api.endpoints import make_hosts
from tests.conftest import World

pytestmark = pytest.mark.django_db

HOSTS = "/admin/machines/host/"
TOKENS = "/admin/machines/enrolmenttoken/"


def slot(world: World, host: Host, status: str) -> MachineInstance:
    return instance_row(world.org, MachineType.objects.get(name="acme-hosts"), status=status, host=host)


def row_of(html: str, name: str) -> str:
    """The list's row whose first column is ``name``."""
    rows = [row for row in html.split("<tr")[1:] if f">{name}</a>" in row]
    assert len(rows) == 1, name
    return rows[0].split("</tr>")[0]


def test_the_host_list_shows_whose_capacity_use_slots_scheduling_and_last_seen(
    world: World, ops: Client
) -> None:
    _, own, shared = make_hosts(world)
    slot(world, own, "claimed")
    slot(world, own, "ready")
    slot(world, own, "terminated")  # ended: takes nothing
    Host.objects.filter(pk=shared.pk).update(
        cordoned_at=timezone.now(), drain_deadline=timezone.now() + timedelta(minutes=10)
    )
    page = ops.get(HOSTS)
    assert page.status_code == 200
    html = page.content.decode()
    row = row_of(html, "rack-1")
    for shown in ("acme", "active", "arch=x86_64, site=fsn1", "2 / 8", "2048 / 16384", "schedulable", "ago"):
        assert shown in row, shown
    assert re.search(r'<td class="field-slots">2</td>', row)
    shared_row = row_of(html, "rack-1-shared")
    assert ">shared<" in shared_row and "draining" in shared_row and "until" in shared_row
    # hosts enroll themselves: no "add", and none is deleted (revoke instead)
    assert f'href="{HOSTS}add/"' not in html and "delete_selected" not in html
    assert 'name="drain_seconds"' in html  # the drain deadline beside the actions
    detail = ops.get(f"{HOSTS}{own.pk}/change/").content.decode()
    assert "8 cpus, 16384 MB memory, 100 GB disk (x86_64)" in detail
    assert "2 cpus, 2048 MB memory, 0 GB disk in 2 slots" in detail
    assert "agent_token_hash" not in detail and own.agent_token_hash not in detail


def test_the_list_costs_the_same_queries_for_one_host_as_for_many(world: World, ops: Client) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    make_hosts(world)
    ops.get(HOSTS)
    with CaptureQueriesContext(connection) as few:
        ops.get(HOSTS)
    for i in range(5):
        _, host, _ = make_hosts(world, f"more-{i}")
        slot(world, host, "claimed")
    with CaptureQueriesContext(connection) as many:
        assert ops.get(HOSTS).content.decode().count("more-") >= 10
    assert len(many.captured_queries) == len(few.captured_queries)


def test_cordon_drain_uncordon_and_revoke_from_the_console(world: World, ops: Client) -> None:
    _, host, _ = make_hosts(world)
    busy, idle = slot(world, host, "claimed"), slot(world, host, "ready")

    assert act(ops, HOSTS, "cordon", host.pk) == ["cordoned: 1"]
    host.refresh_from_db()
    idle.refresh_from_db()
    assert host.cordoned_at is not None and host.drain_deadline is None and idle.status == "terminating"

    response = ops.post(HOSTS, {"action": "drain", "_selected_action": [str(host.pk)]}, follow=True)
    assert [str(m) for m in response.context["messages"]] == [
        "drain: give the deadline in seconds (0 to requeue their jobs at once) beside the action"
    ]
    host.refresh_from_db()
    assert host.drain_deadline is None
    response = ops.post(
        HOSTS, {"action": "drain", "_selected_action": [str(host.pk)], "drain_seconds": "600"}, follow=True
    )
    assert [str(m) for m in response.context["messages"]] == [
        "draining (jobs still running in 10m 00s are requeued): 1"
    ]
    host.refresh_from_db()
    assert timedelta(seconds=590) < host.drain_deadline - timezone.now() <= timedelta(seconds=600)
    busy.refresh_from_db()
    assert busy.status == "claimed"

    assert act(ops, HOSTS, "uncordon", host.pk) == ["uncordoned: 1"]
    host.refresh_from_db()
    assert (host.cordoned_at, host.drain_deadline) == (None, None)

    assert act(ops, HOSTS, "revoke", host.pk) == ["revoked: 1"]
    host.refresh_from_db()
    busy.refresh_from_db()
    assert host.status == "revoked" and busy.status == "terminating"  # its job is requeued
    assert act(ops, HOSTS, "uncordon", host.pk) == [f"{host}: this host is revoked"]
    actors = set(
        Event.objects.filter(
            kind__in=["host.cordoned", "host.draining", "host.uncordoned", "host.revoked"]
        ).values_list("kind", "actor")
    )
    assert actors == {
        ("host.cordoned", "admin:ops"),
        ("host.draining", "admin:ops"),
        ("host.uncordoned", "admin:ops"),
        ("host.revoked", "admin:ops"),
    }


def test_an_operator_prices_and_labels_a_host_through_the_service(world: World, ops: Client) -> None:
    _, host, _ = make_hosts(world)
    url = f"{HOSTS}{host.pk}/change/"
    refused = ops.post(url, {"labels": json.dumps({"k" * 64: "v"}), "monthly_price": "10"})
    assert (
        refused.status_code == 200 and "keys of 1-63, values of 0-63 characters" in refused.content.decode()
    )
    nul = ops.post(url, {"labels": json.dumps({"nul\u0000": "v"}), "monthly_price": "10"})
    assert nul.status_code == 200 and "a label holds no NUL character" in nul.content.decode()
    host.refresh_from_db()
    assert host.monthly_price is None and not Event.objects.filter(kind="host.updated").exists()

    saved = ops.post(url, {"labels": json.dumps({"site": "fsn1", "rack": "2"}), "monthly_price": "99.50"})
    assert saved.status_code == 302
    host.refresh_from_db()
    assert (host.monthly_price, host.labels) == (Decimal("99.50"), {"site": "fsn1", "rack": "2"})
    event = Event.objects.get(kind="host.updated")
    assert event.actor == "admin:ops" and event.data["monthly_price"] == "99.50"


def test_an_enrolment_token_made_in_the_console_is_shown_once(world: World, ops: Client) -> None:
    make_hosts(world)
    account = Host.objects.first().provider_account
    form = {"provider_account": account.pk, "org": world.org.pk, "labels": '{"gpu": "a4000"}', "max_uses": 2}
    refused = ops.post(f"{TOKENS}add/", {**form, "ttl": "soon"})
    assert refused.status_code == 200 and "expires in takes seconds or 90s" in refused.content.decode()
    local = ops.post(f"{TOKENS}add/", {**form, "provider_account": world.account.pk, "ttl": "24h"})
    assert "Select a valid choice" in local.content.decode()  # only accounts of kind hosts
    count = EnrolmentToken.objects.count()
    assert EnrolmentToken.objects.count() == count

    response = ops.post(f"{TOKENS}add/", {**form, "ttl": "2h", "description": "GPU rack"}, follow=True)
    assert response.status_code == 200
    said = [str(m) for m in response.context["messages"]]
    secret = re.search(r"\b(ce_[\w-]{40,})", said[0]).group(1)
    assert said[0].startswith("New enrolment token (shown once, copy it now")
    token = EnrolmentToken.objects.get(token_hash=hash_token(secret))
    assert (token.org, token.labels, token.max_uses, token.created_by) == (
        world.org, {"gpu": "a4000"}, 2, "admin:ops",
    )  # fmt: skip
    assert timedelta(minutes=119) < token.expires_at - timezone.now() <= timedelta(hours=2)
    # never again: not on its page, not in the list
    assert secret not in ops.get(f"{TOKENS}{token.pk}/change/").content.decode()
    listed = ops.get(TOKENS).content.decode()
    assert secret not in listed and token.prefix in listed and "0 / 2" in listed and "active" in listed
    host, _ = host_enroll(
        enrolment_token=secret, hostname="gpu-1", capacity=HostCapacity(cpus=2, memory_mb=2048)
    )
    assert host.org == world.org and host.labels == {"gpu": "a4000"}

    shared = ops.post(f"{TOKENS}add/", {**form, "org": "", "ttl": "1h"}, follow=True)
    shared_secret = re.search(r"\b(ce_[\w-]{40,})", str(list(shared.context["messages"])[0])).group(1)
    assert EnrolmentToken.objects.get(token_hash=hash_token(shared_secret)).org is None
    assert ">shared<" in ops.get(TOKENS).content.decode()

    assert act(ops, TOKENS, "revoke", token.pk) == ["revoked: 1"]
    token.refresh_from_db()
    assert token.revoked_at is not None and "revoked" in ops.get(TOKENS).content.decode()
    assert Event.objects.filter(kind="enrolment_token.revoked", actor="admin:ops").count() == 1


def test_the_fleet_group_lists_hosts_and_their_tokens(world: World, ops: Client) -> None:
    groups = {
        app["name"]: [m["name"] for m in app["models"]] for app in ops.get("/admin/").context["app_list"]
    }
    assert groups["Fleet"][:4] == ["Machines", "Pools", "Enrolled hosts", "Enrolment tokens"]
