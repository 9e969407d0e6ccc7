"""Every read in the endpoint table keeps to a query budget, and lists cost the same number of
queries for 1 row as for many (no N+1). NetBox keeps such baselines; ours are below: raise one
only with a reason in the commit that does it."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.events.services import event_record
from apps.jobs.models import Job, JobConfiguration
from apps.machines.models import Budget
from apps.resources.models import ResourceInstance, ResourceType
from testkit.builders import instance_row, pool_row, provider_account
from tests.api.endpoints import ENDPOINTS, Endpoint, make_hosts, make_objects
from tests.conftest import World

READS = [ep for ep in ENDPOINTS if ep.method == "get"]

# Queries per call, the token's lookup included (one prepared statement), measured after a
# first call (which also writes the token's last_used_at).
BUDGETS = {
    "machine types": 5,
    "machine type": 4,
    "instances": 3,
    "instance": 2,
    "job configs": 4,
    "job config": 3,
    "events": 3,
    "event": 2,
    "pools": 6,
    "pool": 4,
    "jobs": 3,
    "job": 3,
    "job logs": 3,
    "job artifacts": 3,
    "resources": 3,
    "resource": 2,
    "budgets": 4,
    "budget": 3,
    "hosts": 5,
    "host": 4,
    "enrolment tokens": 3,
    "enrolment token": 2,
    "provider accounts": 4,
    "provider account": 3,
}


def _more_objects(world: World, n: int) -> None:
    """``n`` more rows of every listed kind in ``acme`` (pools with members, jobs with resources)."""
    rtype = ResourceType.objects.get(id="scratch")
    for i in range(n):
        instance_row(world.org, world.machine_type, status="ready")
        config = JobConfiguration.objects.create(
            org=world.org, name=f"more-{i}", machine_type=world.machine_type, command="make"
        )
        event_record(kind="org.member_set", org=world.org, actor="test")
        pool = pool_row(world.org, world.machine_type, f"warm-{i}", target_size=2, max_size=2)
        for status in ("ready", "claimed"):
            instance_row(world.org, world.machine_type, status=status, pool=pool, ready_at=timezone.now())
        job = Job.objects.create(
            org=world.org, config=config, machine_type=world.machine_type, command="make"
        )
        ResourceInstance.objects.create(resource_type=rtype, org=world.org, job=job, status="held")
        make_hosts(world, f"rack-more-{i}")  # a token, an own and a shared host
        provider_account("hetzner", f"acme-cloud-{i}", {}, {"token": "t"}, org=world.org)
    for machine_type, period in ((world.machine_type, "month"), (None, "day"), (world.machine_type, "day")):
        Budget.objects.create(org=world.org, machine_type=machine_type, period=period, amount=10)


def _count(world: World, ep: Endpoint, ids: dict[str, str]) -> tuple[int, int]:
    client = world.client("admin")
    client.get("/api/v1/events/")  # the token's last_used_at is written at most once a minute
    with CaptureQueriesContext(connection) as ctx:
        response = client.get(ep.path.format(**ids))
    assert response.status_code == 200, response.content
    return len(ctx.captured_queries), len(response.json().get("results", [])) if ep.is_list else 1


def test_every_read_has_a_budget() -> None:
    assert {ep.name for ep in READS} == set(BUDGETS)


@pytest.mark.django_db
@pytest.mark.parametrize("ep", READS, ids=lambda ep: ep.name)
def test_reads_keep_their_query_budget_and_lists_do_not_grow_with_rows(world: World, ep: Endpoint) -> None:
    ids = make_objects(world)
    few, rows_few = _count(world, ep, ids)
    assert few <= BUDGETS[ep.name], f"{ep.name}: {few} queries, budget {BUDGETS[ep.name]}"
    if ep.is_list:
        _more_objects(world, 4)
        many, rows_many = _count(world, ep, ids)
        assert rows_many > rows_few or ep.name == "machine types"  # the list did grow
        assert many == few, f"{ep.name}: {few} queries for {rows_few} rows, {many} for {rows_many}"
