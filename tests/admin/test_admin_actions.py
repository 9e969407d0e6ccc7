"""The console's actions call the same services as the API and say what happened."""

from __future__ import annotations

import pytest
from django.test import Client
from django.utils import timezone

from apps.pools.models import InstancePool
from testkit.builders import instance_row, job_config, job_row, pool_row
from tests.conftest import World

pytestmark = pytest.mark.django_db


def act(client: Client, url: str, action: str, pk: object) -> list[str]:
    response = client.post(url, {"action": action, "_selected_action": [str(pk)]}, follow=True)
    assert response.status_code == 200
    return [str(m) for m in response.context["messages"]]


def test_drain_a_pool_from_the_console(world: World, ops: Client) -> None:
    pool = pool_row(world.org, world.machine_type, status="ready")
    member = instance_row(world.org, world.machine_type, pool=pool, status="ready", ready_at=timezone.now())
    messages = act(ops, "/admin/pools/instancepool/", "drain_terminate", pool.pk)
    assert messages == ["drained (members terminated): 1"]
    pool.refresh_from_db()
    member.refresh_from_db()
    assert (pool.status, member.status) == ("drained", "terminating")
    # Draining it again is refused, and the operator is told why.
    messages = act(ops, "/admin/pools/instancepool/", "drain_terminate", pool.pk)
    assert "cannot move it to draining" in messages[0]


def test_terminate_an_instance_and_cancel_a_job_from_the_console(world: World, ops: Client) -> None:
    instance = instance_row(world.org, world.machine_type, status="ready")
    assert act(ops, "/admin/machines/machineinstance/", "terminate", instance.pk) == ["terminating: 1"]
    instance.refresh_from_db()
    assert instance.status == "terminating"
    job = job_row(job_config(world.org, world.machine_type, "c", "x"))
    assert act(ops, "/admin/jobs/job/", "cancel", job.pk) == ["cancelled or cancel requested: 1"]
    job.refresh_from_db()
    assert job.status == "cancelled"


def test_a_pool_created_in_the_console_is_validated_like_the_api(world: World, ops: Client) -> None:
    response = ops.post(
        "/admin/pools/instancepool/add/",
        {
            "org": world.org.pk,
            "name": "too-big",
            "machine_type": world.machine_type.pk,
            "target_size": 50,
            "min_size": 0,
            "max_size": 50,
            "warmup_grace_seconds": 600,
            "schedules-TOTAL_FORMS": 0,
            "schedules-INITIAL_FORMS": 0,
            "members-TOTAL_FORMS": 0,
            "members-INITIAL_FORMS": 0,
        },
    )
    assert response.status_code == 200
    assert "exceeds the organization&#x27;s max_pool_size 10" in response.content.decode()
    assert not InstancePool.objects.filter(name="too-big").exists()
    response = ops.post(
        "/admin/pools/instancepool/add/",
        {
            "org": world.org.pk,
            "name": "fine",
            "machine_type": world.machine_type.pk,
            "target_size": 2,
            "min_size": 0,
            "max_size": 3,
            "warmup_grace_seconds": 600,
            "schedules-TOTAL_FORMS": 0,
            "schedules-INITIAL_FORMS": 0,
            "members-TOTAL_FORMS": 0,
            "members-INITIAL_FORMS": 0,
        },
    )
    assert response.status_code == 302
    pool = InstancePool.objects.get(name="fine")
    from apps.events.models import Event

    assert Event.objects.filter(kind="pool.created", pool_id=pool.pk, actor="admin:ops").exists()
