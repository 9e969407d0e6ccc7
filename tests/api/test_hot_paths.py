"""The acquire endpoint's hot path: two queries (the caller, the claim), no broker round trip,
an answer identical to the documented serializer's, and no shortcut that outlives a revoke."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.core.cache import caches
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.settings import api_settings

from apps.machines.api.serializers import InstanceSerializer
from apps.machines.models import MachineInstance
from apps.orgs.models import ApiToken, Membership
from apps.orgs.services import api_token_revoke
from apps.pools.models import InstancePool
from apps.pools.services import pool_create
from tests.conftest import World

pytestmark = pytest.mark.django_db


def warm_pool(world: World, members: int = 5) -> InstancePool:
    pool = pool_create(org=world.org, name="hot", machine_type=world.machine_type, target_size=0, max_size=10)
    now = timezone.now()
    MachineInstance.objects.bulk_create(
        MachineInstance(
            org=world.org,
            machine_type=world.machine_type,
            provider_account=world.account,
            pool=pool,
            status="ready",
            ready_at=now,
            last_heartbeat_at=now,
        )
        for _ in range(members)
    )
    return pool


def acquire(world: World, pool: InstancePool, who: str = "member") -> Any:
    return world.client(who).post(f"/api/v1/pools/{pool.pk}/acquire/", {"acquired_by": "ci"}, format="json")


@pytest.mark.django_db(transaction=True)
def test_acquire_costs_two_queries_and_no_broker_call(tworld: World, monkeypatch: pytest.MonkeyPatch) -> None:
    world = tworld  # autocommit, as under a web server: the claim is one statement
    pool = warm_pool(world)
    acquire(world, pool)  # first call of the process: last_used_at is written once a minute
    broker_calls: list[Any] = []
    monkeypatch.setattr("apps.core.broker.enqueue", lambda *a: broker_calls.append(a))
    monkeypatch.setattr("redis.Redis.execute_command", lambda *a, **k: broker_calls.append(a))
    with CaptureQueriesContext(connection) as queries:
        answer = acquire(world, pool)
    assert answer.status_code == 201
    assert len(queries.captured_queries) == 2, [q["sql"][:80] for q in queries.captured_queries]
    assert broker_calls == []
    assert InstancePool.objects.get(pk=pool.pk).refill_requested_at is not None  # the claim asked


def test_the_acquire_answer_is_exactly_the_documented_instance(world: World) -> None:
    pool = warm_pool(world)
    answer = acquire(world, pool)
    body = json.loads(answer.content)
    row = MachineInstance.objects.select_related("machine_type", "provider_account").get(
        pk=body["instance"]["id"]
    )
    expected = json.loads(json.dumps(InstanceSerializer(row).data))
    assert body["instance"] == expected
    assert body["instance"]["machine_type"] == world.machine_type.name
    assert body["instance"]["provider"] == "local"
    assert body["claim_id"] == str(row.claim_id)


def test_a_revoked_token_or_a_removed_member_is_refused_at_once(world: World) -> None:
    pool = warm_pool(world)
    assert acquire(world, pool).status_code == 201
    Membership.objects.filter(org=world.org, user=world.users["member"]).delete()
    assert acquire(world, pool).status_code == 403
    token = ApiToken.objects.get(org=world.org, user=world.users["admin"])
    assert acquire(world, pool, "admin").status_code == 201
    api_token_revoke(token=token)
    assert acquire(world, pool, "admin").status_code == 401


def test_the_throttle_counts_in_process_and_answers_429_with_a_code(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    from apps.core.throttling import UserRateThrottle

    caches["local"].clear()
    monkeypatch.setattr(
        UserRateThrottle, "THROTTLE_RATES", {**api_settings.DEFAULT_THROTTLE_RATES, "user": "3/min"}
    )
    api = world.client("viewer")
    codes = [api.get("/api/v1/pools/").status_code for _ in range(4)]
    assert codes == [200, 200, 200, 429]
    assert api.get("/api/v1/pools/").json()["code"] == "throttled"
    assert world.client("member").get("/api/v1/pools/").status_code == 200  # per user
    caches["local"].clear()
