"""Issue: warm pools, end to end with the local driver, a real worker and real beat."""

from __future__ import annotations

import pytest

from apps.events.models import Event
from apps.machines.models import MachineInstance
from tests.e2e.conftest import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def pool_state(stack: Stack, pool_id: str) -> dict:
    return stack.api("viewer").get(f"/api/v1/pools/{pool_id}/").json()


def ready_members(body: dict) -> int:
    return sum(1 for m in body["members"] if m["status"] == "ready")


def test_the_whole_pool_life_cycle(stack: Stack) -> None:
    admin, member = stack.api("admin"), stack.api("member")
    created = admin.post(
        "/api/v1/pools/",
        {
            "name": "ci",
            "description": "CI runners",
            "machine_type": str(stack.world.machine_type.pk),
            "target_size": 5,
            "min_size": 1,
            "max_size": 8,
            "warmup_grace_seconds": 120,
        },
        format="json",
    )
    assert created.status_code == 201, created.content
    pool_id = created.json()["id"]
    assert created.json()["status"] == "warming" and created.json()["members"] == []

    # Warm: five agents enroll and beat; the pool reads ready.
    body = stack.wait(
        lambda: (b := pool_state(stack, pool_id))["status"] == "ready" and b, 90, "5 ready members"
    )
    assert ready_members(body) == 5
    assert all(m["warmed_at"] for m in body["members"])

    # Acquire three.
    claims = []
    for i in range(3):
        response = member.post(
            f"/api/v1/pools/{pool_id}/acquire/",
            {"acquired_by": "runner", "acquired_for": f"b{i}"},
            format="json",
        )
        assert response.status_code == 201, response.content
        claims.append(response.json())
    assert len({c["instance"]["id"] for c in claims}) == 3
    assert all(c["instance"]["status"] == "claimed" for c in claims)

    # Replenished back to five ready without waiting for the reaper's tick to notice.
    stack.wait(lambda: ready_members(pool_state(stack, pool_id)) == 5, 90, "the pool to refill to 5 ready")

    # Terminate one claimed machine: it ends at the provider.
    victim = claims[0]["instance"]["id"]
    assert member.post(f"/api/v1/instances/{victim}/terminate/").status_code == 403  # admins only
    assert admin.post(f"/api/v1/instances/{victim}/terminate/").status_code == 202
    stack.wait(lambda: MachineInstance.objects.get(pk=victim).status == "terminated", 30, "termination")

    # Drain with terminate, then delete.
    assert admin.delete(f"/api/v1/pools/{pool_id}/").status_code == 409  # not drained yet
    drained = admin.post(f"/api/v1/pools/{pool_id}/drain/", {"terminate_members": True}, format="json")
    assert drained.status_code == 200
    assert drained.json() == {"drained": True, "terminated_count": 7}  # 5 ready + 2 still claimed
    assert (
        member.post(f"/api/v1/pools/{pool_id}/acquire/", {}, format="json").json()["code"] == "invalid_state"
    )
    stack.wait(
        lambda: (
            not MachineInstance.objects.filter(pool_id=pool_id)
            .exclude(status__in=["terminated", "failed", "lost"])
            .exists()
        ),
        60,
        "every member to be terminated",
    )
    assert admin.delete(f"/api/v1/pools/{pool_id}/").status_code == 204

    kinds = list(Event.objects.filter(pool_id=pool_id).order_by("id").values_list("kind", flat=True))
    order = [
        "pool.created",
        "pool.member_provisioned",
        "pool.member_warmed",
        "pool.ready",
        "pool.member_claimed",
        "pool.replenishing",
        "pool.member_terminated",
        "pool.draining",
        "pool.drained",
        "pool.deleted",
    ]
    positions = [kinds.index(k) for k in order]
    assert positions == sorted(positions), kinds
    assert kinds.count("pool.member_claimed") == 3
    events = stack.api("viewer").get(f"/api/v1/events/?kind_prefix=pool&pool_id={pool_id}&limit=500").json()
    assert events["results"][0]["kind"] == "pool.deleted"  # newest first
