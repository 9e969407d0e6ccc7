"""For every endpoint and action: another org's user gets 404 (or never sees the object),
a role too low gets 403 and changes nothing, no token gets 401, the right role succeeds."""

from __future__ import annotations

import pytest

from apps.events.models import Event
from apps.machines.models import OrgMachineType
from tests.api.endpoints import ENDPOINTS, Endpoint, make_objects
from tests.conftest import World

pytestmark = pytest.mark.django_db

ROLES = ["viewer", "member", "admin"]
RANK = {r: i for i, r in enumerate(ROLES)}


def call(world: World, who: str, ep: Endpoint, ids: dict[str, str]):
    client = world.client(who)
    return getattr(client, ep.method)(ep.path.format(**ids), ep.body(ids), format="json")


def snapshot() -> tuple:
    """Everything a write could change, except the events log's own growth from reads."""
    from apps.jobs.models import Job, JobConfiguration
    from apps.machines.models import (
        Budget,
        EnrolmentToken,
        Host,
        MachineInstance,
        MachineType,
        ProviderAccount,
    )
    from apps.pools.models import InstancePool
    from apps.resources.models import ResourceInstance

    return (
        sorted(JobConfiguration.objects.values_list("id", "name", "priority", "command")),
        sorted(MachineInstance.objects.values_list("id", "status")),
        sorted(InstancePool.objects.values_list("id", "status", "target_size")),
        sorted(Job.objects.values_list("id", "status", "cancel_requested")),
        sorted(ResourceInstance.objects.values_list("id", "status")),
        sorted(Budget.objects.values_list("id", "amount", "period")),
        sorted(Host.objects.values_list("id", "status", "cordoned_at", "drain_deadline", "monthly_price")),
        sorted((str(h.pk), h.labels) for h in Host.objects.all()),
        sorted(EnrolmentToken.objects.values_list("id", "revoked_at", "uses")),
        sorted(ProviderAccount.objects.values_list("id", "name", "credentials_encrypted")),
        sorted(MachineType.objects.values_list("id", "name", "description", "version")),
        sorted(OrgMachineType.objects.values_list("id", "max_instances")),
        Event.objects.exclude(kind__startswith="test.").count(),
    )


@pytest.mark.parametrize("ep", ENDPOINTS, ids=lambda ep: ep.name)
def test_outsider_sees_nothing_of_another_org(world: World, ep: Endpoint) -> None:
    ids = make_objects(world)
    before = snapshot()
    response = call(world, "outsider", ep, ids)
    if ep.is_list:
        assert response.status_code == 200
        listed = {str(row["id"]) for row in response.json()["results"]}
        assert not listed & set(ids.values()), "another org's objects were listed"
    elif ep.method == "post" and "{" not in ep.path:
        # Creating with references to acme's objects: they do not exist for the outsider (a
        # machine type: "no grant for <the reference> in organization rival", as for one that
        # exists nowhere).
        assert response.status_code == 400, response.content
        fields = str(response.json()["fields"])
        assert "does not exist" in fields or (
            ("no grant for" in fields or "no provider account" in fields)
            and "in organization rival" in fields
        )
    else:
        assert response.status_code == 404, response.content
        assert response.json()["code"] == "not_found"
    assert snapshot() == before


@pytest.mark.parametrize("ep", ENDPOINTS, ids=lambda ep: ep.name)
def test_roles(world: World, ep: Endpoint) -> None:
    ids = make_objects(world)
    for role in ROLES:
        if RANK[role] >= RANK[ep.role]:
            continue
        before = snapshot()
        response = call(world, role, ep, ids)
        assert response.status_code == 403, (role, response.content)
        assert response.json()["code"] == "permission_denied"
        assert snapshot() == before
    response = call(world, ep.role, ep, ids)
    assert response.status_code in ep.ok, response.content


@pytest.mark.parametrize("ep", ENDPOINTS, ids=lambda ep: ep.name)
def test_no_token_is_401(world: World, ep: Endpoint) -> None:
    ids = make_objects(world)
    response = call(world, "anonymous", ep, ids)
    assert response.status_code == 401
    assert response.json()["code"] == "not_authenticated"
    assert response["WWW-Authenticate"] == "Bearer"
