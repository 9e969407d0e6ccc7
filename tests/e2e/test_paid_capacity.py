"""Paid capacity first, end to end over REST: a warm pool of 2 in front of a reusable
configuration on the local provider (real worker, beat and agents). A machine the org already
pays for is used before another is bought: sequential jobs share one machine, a burst buys
only what it needs, and the event log shows no purchase while a paid machine could serve."""

from __future__ import annotations

from typing import Any

import pytest

from apps.events.models import Event
from apps.machines.models import MachineInstance, OrgMachineType
from testkit.purchases import needless_purchases, story
from tests.e2e.conftest import Stack
from tests.e2e.test_jobs_and_agent import job, job_config, submit

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

SEQUENTIAL, BURST, POOL = 12, 6, 2
ENDED = ("succeeded", "failed", "cancelled", "timed_out")


def bought(stack: Stack) -> int:
    return MachineInstance.objects.filter(org=stack.world.org, machine_type=stack.world.machine_type).count()


def warm_pool(stack: Stack) -> str:
    mt = str(stack.world.machine_type.pk)
    body = {"name": "front", "machine_type": mt, "target_size": POOL, "max_size": POOL}
    response = stack.api("admin").post("/api/v1/pools/", body, format="json")
    assert response.status_code == 201, response.content
    pool = response.json()["id"]
    stack.wait(
        lambda: stack.api("viewer").get(f"/api/v1/pools/{pool}/").json()["status"] == "ready", 60, "the pool"
    )
    return pool


def run_and_wait(stack: Stack, config: str, n: int) -> list[dict[str, Any]]:
    ids = [submit(stack, config) for _ in range(n)]
    stack.wait(
        lambda: all(job(stack, j)["status"] in ENDED for j in ids),
        120,
        f"{n} jobs to end",
    )
    return [job(stack, j) for j in ids]


def scenario(stack: Stack, policy: str) -> tuple[int, int]:
    OrgMachineType.objects.filter(org=stack.world.org, machine_type=stack.world.machine_type).update(
        policy=policy
    )
    warm_pool(stack)
    config = job_config(stack, f"unit-{policy}", "sleep 1", reuse="reuse")
    done = [run_and_wait(stack, config, 1)[0] for _ in range(SEQUENTIAL)]
    after_sequence = bought(stack)
    done += run_and_wait(stack, config, BURST)
    assert [j["status"] for j in done] == ["succeeded"] * (SEQUENTIAL + BURST)
    events = list(Event.objects.filter(org=stack.world.org).order_by("id"))
    found = needless_purchases(events)
    assert found == [], story(events, found)
    return after_sequence, bought(stack)


def test_cost_policy_uses_what_it_pays_for_before_buying(stack: Stack) -> None:
    after_sequence, after_burst = scenario(stack, "cost")
    assert after_sequence <= 4, f"{after_sequence} machines bought for {SEQUENTIAL} sequential jobs"
    assert after_burst <= 8, f"{after_burst} machines bought after a burst of {BURST}"


def test_speed_policy_stays_within_the_target_plus_peak_concurrency(stack: Stack) -> None:
    after_sequence, after_burst = scenario(stack, "speed")
    assert after_sequence <= 4, f"{after_sequence} machines bought for {SEQUENTIAL} sequential jobs"
    assert after_burst <= POOL + BURST, f"{after_burst} machines bought after a burst of {BURST}"
