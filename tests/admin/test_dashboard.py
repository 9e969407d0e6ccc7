"""The live dashboard: what an operator sees, from the database, in a bounded number of queries."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.billing.budgets import budget_set
from apps.events.kinds import EventKind
from apps.events.models import Event
from apps.events.services import event_record
from apps.jobs.models import Job, JobConfiguration
from apps.machines.budgets import budget_spend
from apps.pools.models import InstancePool
from testkit.builders import instance_row, job_config, job_row, pool_row
from tests.admin.test_console_pages import ci_world
from tests.conftest import World

pytestmark = pytest.mark.django_db


def busy_fleet(world: World, pools: int = 2) -> None:
    """``pools`` pools with members in several states, queued and finished jobs, a failure."""
    now = timezone.now()
    config = JobConfiguration.objects.filter(org=world.org, name="build").first() or job_config(
        world.org, world.machine_type, "build", "make"
    )
    for p in range(pools):
        pool = pool_row(
            world.org,
            world.machine_type,
            f"runners-{p}-{InstancePool.objects.count()}",
            target_size=3,
            min_size=1,
            max_size=5,
            status="ready",
        )
        for status in ("ready", "ready", "claimed", "warming"):
            instance_row(
                world.org,
                world.machine_type,
                pool=pool,
                status=status,
                provisioning_started_at=now - timedelta(minutes=20),
            )
    for _ in range(3):
        job_row(config, pending_reason="max_concurrent_jobs 10/10")
    Job.objects.filter(pending_reason="max_concurrent_jobs 10/10").update(
        queued_at=now - timedelta(minutes=7)
    )
    for status in ("succeeded", "succeeded", "failed"):
        job = job_row(config, status=status)
        Job.objects.filter(pk=job.pk).update(
            queued_at=now - timedelta(minutes=10),
            started_at=now - timedelta(minutes=9),
            finished_at=now - timedelta(minutes=2),
        )
    job = Job.objects.filter(status="failed").first()
    event_record(
        kind=EventKind.JOB_REQUEUED, org=world.org, job=job, reason="machine_lost: agent silent for 90s"
    )


def test_dashboard_shows_pools_queue_quotas_machines_failures_and_charts(world: World, ops: Client) -> None:
    busy_fleet(world)
    budget_set(org=world.org, amount=Decimal("50"), period="month", actor="test")

    response = ops.get("/admin/dashboard/")

    assert response.status_code == 200
    html = response.content.decode()
    # refreshes itself with htmx, served from our own static files
    assert 'hx-trigger="every 5s"' in html and "django_htmx/htmx-2.min.js" in html
    snap = response.context
    bars = {p.name: p for p in snap["pools"]}
    assert len(bars) == 2
    bar = next(iter(bars.values()))
    assert bar.counts == {"ready": 2, "claimed": 1, "warming": 1}
    assert (bar.target, bar.min, bar.max) == (3, 1, 5)
    assert "4 live · target 3 · min 1 · max 5" in html
    # the queue by pending reason, with the oldest wait
    (queue,) = snap["queue"]
    assert queue["reason"] == "max_concurrent_jobs 10/10" and queue["count"] == 3
    assert 7 * 60 <= queue["oldest_wait"] < 8 * 60
    assert "7m 0" in html
    # quotas x/y: 8 live machines of the 20 the grant allows
    acme = next(q for q in snap["quotas"] if q["org"] == "acme")
    usage = {u["name"]: (u["used"], u["limit"]) for u in acme["usage"]}
    assert usage["machines"] == (8, 20) and usage["jobs"] == (0, 10)
    assert "machines 8/20" in html
    # machines by state and provider
    (local,) = snap["machines"]["rows"]
    assert local["account"] == "local" and local["total"] == 8
    # failures and requeues with their reasons
    kinds = [t["kind"] for t in snap["trouble"]]
    assert kinds[0] == "job.requeued" and "machine_lost: agent silent for 90s" in html
    # throughput and wait over the last hour, from the jobs table
    series = snap["series"]
    assert sum(series["succeeded"]) == 2 and sum(series["failed"]) == 1
    assert max(series["wait_max"]) == pytest.approx(60.0)
    assert "<svg" in snap["throughput_svg"] and "<svg" in snap["wait_svg"]
    # cost: spent + committed this month agrees with the budget's own figure
    (cost,) = snap["costs"]["rows"]
    budget = world.org.budgets.get()
    assert cost["month"] == budget_spend(budget, now=timezone.now())
    assert cost["budgets"][0]["used"] == cost["month"]
    assert "/50.00 per month" in html


def test_the_dashboard_costs_the_same_number_of_queries_for_3_pools_or_30(world: World, ops: Client) -> None:
    busy_fleet(world, pools=1)
    ops.get("/admin/dashboard/panel/")  # warm up (session, content types)
    with CaptureQueriesContext(connection) as small:
        assert ops.get("/admin/dashboard/panel/").status_code == 200
    busy_fleet(world, pools=10)
    with CaptureQueriesContext(connection) as large:
        response = ops.get("/admin/dashboard/panel/")
    assert len(response.context["pools"]) == 11
    assert len(large.captured_queries) == len(small.captured_queries)
    assert len(large.captured_queries) <= 21  # the fleet's figures; CI: no endpoint, no class

    # The CI panel: a fixed number more, whatever the number of connections, classes and jobs.
    ci_world(world)
    with CaptureQueriesContext(connection) as small:
        assert ops.get("/admin/dashboard/panel/").status_code == 200
    more_ci(world)
    with CaptureQueriesContext(connection) as large:
        response = ops.get("/admin/dashboard/panel/")
    assert len(response.context["ci"]["endpoints"]) == 3 and len(response.context["ci"]["classes"]) == 3
    assert len(large.captured_queries) == len(small.captured_queries)
    assert len(large.captured_queries) <= 28


def more_ci(world: World) -> None:
    """A second org's GitHub installation and class, with jobs."""
    from apps.github.models import GitHubConnection, GitHubInstallation, RunnerClass, WorkflowJob

    conn = GitHubConnection.objects.create(org=world.other_org, app_id=8)
    inst = GitHubInstallation.objects.create(connection=conn, org=world.other_org, installation_id=5)
    rc = RunnerClass.objects.create(
        org=world.other_org, name="big", labels=["catacloud-big"], machine_type=world.machine_type
    )
    for n in range(5):
        WorkflowJob.objects.create(
            installation=inst, org=world.other_org, runner_class=rc, github_id=n, run_id=1,
            repository="rival/app", status="queued",
        )  # fmt: skip


def test_dashboard_is_for_staff_only(world: World) -> None:
    client = Client()
    response = client.get("/admin/dashboard/")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]
    get_user_model().objects.create_user("plain", password="a-long-plain-password")
    client.login(username="plain", password="a-long-plain-password")
    assert client.get("/admin/dashboard/panel/").status_code == 302


def test_dashboard_shows_the_idle_share_of_the_last_hour_and_the_machines_idle_now(
    world: World, ops: Client
) -> None:
    from testkit.builders import idle_machine

    # Given a machine that ran a job for 10 of the last 40 minutes and has been idle since
    now = timezone.now()
    machine = idle_machine(world.org, world.machine_type, provisioning_started_at=now - timedelta(minutes=40))
    for kind, minutes in (("instance.claimed", 40), ("instance.released", 30)):
        event = event_record(kind=kind, org=world.org, instance=machine, actor="test")
        Event.objects.filter(pk=event.pk).update(created_at=now - timedelta(minutes=minutes))
    # When the operator opens the dashboard
    response = ops.get("/admin/dashboard/")
    # Then the cost row says what share of the hour's money ran no job, and what idles now
    (cost,) = response.context["costs"]["rows"]
    assert cost["idle_now"] == 1
    # of the 40 minutes it lived (and billed) in the last hour, 30 were idle (the 20 still to
    # come of its paid hour are not spent yet)
    assert cost["idle_share"] == pytest.approx(30 / 40, abs=0.01)
    assert "75.0% <small>(1 idle now)</small>" in response.content.decode()


def test_cancelled_jobs_are_counted_apart_from_failed_ones(world: World, ops: Client) -> None:
    """ "11 finished, 4 failed" counted cancelled jobs as failures."""
    config = job_config(world.org, world.machine_type, "build", "make")
    now = timezone.now()
    for status in ("succeeded", "succeeded", "failed", "timed_out", "cancelled", "cancelled"):
        job = job_row(config, status=status)
        Job.objects.filter(pk=job.pk).update(finished_at=now - timedelta(minutes=2))
    html = ops.get("/admin/dashboard/").content.decode()
    assert "Last hour: 6 submitted, 6 finished: 2 succeeded, 2 failed, 2 cancelled." in html
    series = ops.get("/admin/dashboard/").context["series"]
    assert (sum(series["succeeded"]), sum(series["failed"]), sum(series["cancelled"])) == (2, 2, 2)


def test_machines_that_ended_with_the_previous_make_dev_are_not_failures(
    world: World, ops: Client, tmp_path: object
) -> None:
    """A restart of `make dev` marks the local machines of the previous run lost: that is what a
    restart does, not a failure to act on. A machine lost while the system runs still is one."""
    from apps.machines.reconcile import reconcile_local_machines

    ended = instance_row(world.org, world.machine_type, status="ready", provider_id="gone-with-the-restart")
    reconcile_local_machines()
    ended.refresh_from_db()
    assert ended.status == "lost"
    assert ended.failure_reason == "its local machine ended with the previous `make dev`"
    lost_later = instance_row(world.org, world.machine_type, status="ready", provider_id="f-9")
    from apps.machines.lifecycle import instance_mark_lost

    instance_mark_lost(instance_id=lost_later.pk, actor="reaper", reason="agent silent for 90s")
    trouble = ops.get("/admin/dashboard/").context["trouble"]
    assert [t["instance_id"] for t in trouble] == [lost_later.pk]


def test_the_cost_rows_say_what_organizations_own_accounts_paid(world: World, ops: Client) -> None:
    """Of an organization's month, what its own cloud account paid (its cloud bills it, not the
    operator) stands apart."""
    from apps.machines.models import MachineType, OrgMachineType
    from testkit.builders import provider_account

    own_account = provider_account("hetzner", "acme-cloud", {}, {"token": "t"}, org=world.org)
    own = MachineType.objects.create(
        name="acme-own", provider_account=own_account, org=world.org, server_type="cx23", cpus=2,
        memory_mb=4096, price_per_hour=Decimal("0.5"), billing_increment_seconds=3600,
    )  # fmt: skip
    OrgMachineType.objects.create(org=world.org, machine_type=own)
    now = timezone.now()
    for machine_type in (own, world.machine_type):  # an hour's period of each, ended this month
        instance_row(
            world.org, machine_type, status="terminated", provisioning_started_at=now - timedelta(seconds=20),
            ended_at=now - timedelta(seconds=10), cost=machine_type.price_per_hour,
        )  # fmt: skip
    response = ops.get("/admin/dashboard/")
    (cost,) = response.context["costs"]["rows"]
    assert cost["month_own"] == Decimal("0.5")
    assert cost["month"] == Decimal("0.5") + world.machine_type.price_per_hour
    assert '<td class="cc-num cc-own">0.50</td>' in response.content.decode()
