"""Costs people ask about: GET /costs/ by day, config, pool, machine type and kind; a job's and
an instance's cost; export_costs; budgets over the API. Every cent of a machine is placed."""

from __future__ import annotations

import csv
import io
from datetime import timedelta
from decimal import Decimal

import pytest
from django.core.management import call_command
from django.utils import timezone

from apps.events.models import Event
from apps.events.services import event_record
from apps.jobs.models import Job, JobConfiguration
from apps.jobs.reports import job_finished, job_started
from apps.jobs.scheduler import schedule
from apps.jobs.submission import job_submit
from apps.machines.choices import InstanceStatus
from apps.machines.lifecycle import instance_terminate
from apps.machines.models import MachineInstance
from apps.machines.services import INSTANCE_STATES
from testkit.builders import idle_machine, instance_row, job_config, job_row, pool_row
from tests.conftest import World
from tests.jobs.common import refresh

pytestmark = pytest.mark.django_db
S = InstanceStatus


def _event(kind: str, at, instance: MachineInstance, job: Job | None = None, **data) -> None:
    e = event_record(kind=kind, org=instance.org_id, instance=instance, job=job, actor="test", **data)
    Event.objects.filter(pk=e.pk).update(created_at=at)


@pytest.fixture
def history(world: World) -> dict:
    """A pool machine billed per started hour at 0.36/h (0.0001/s): warm 600 s, job A 1200 s,
    idle 300 s, job B 600 s, terminating 100 s; one hour billed, 800 s of it unused."""
    mt = world.machine_type
    mt.price_per_hour = Decimal("0.36")
    mt.save()
    t0 = timezone.now().replace(microsecond=0) - timedelta(hours=3)
    pool = pool_row(world.org, mt, "ci")
    cfg_a, cfg_b = job_config(world.org, mt, "unit", "x"), job_config(world.org, mt, "lint", "x")
    a = job_row(cfg_a, status="succeeded")
    b = job_row(cfg_b, status="succeeded")
    m = instance_row(
        world.org,
        mt,
        pool=pool,
        status=S.TERMINATED,
        provisioning_started_at=t0,
        ended_at=t0 + timedelta(seconds=2800),
        billed_seconds=3600,
        cost=Decimal("0.36"),
    )
    _event("pool.member_requested", t0 - timedelta(seconds=1), m)
    _event("pool.member_claimed", t0 + timedelta(seconds=600), m, a, claim_id="c1")
    _event("instance.released", t0 + timedelta(seconds=1800), m)
    _event("instance.claimed", t0 + timedelta(seconds=2100), m, b, claim_id="c2")
    _event("instance.terminating", t0 + timedelta(seconds=2700), m)
    _event("instance.terminated", t0 + timedelta(seconds=2800), m)
    return {"t0": t0, "machine": m, "a": a, "b": b}


def _get(world: World, who: str, path: str):
    return world.client(who).get(path)


def test_costs_by_kind_config_pool_and_day_add_up_to_the_billed_cost(world: World, history: dict) -> None:
    day = history["t0"].date()
    url = f"/api/v1/costs/?from={day - timedelta(days=1)}&to={day + timedelta(days=2)}"
    by_kind = _get(world, "viewer", url + "&group_by=kind").json()
    assert by_kind["currency"] == "USD"
    assert by_kind["total"] == "0.360000"
    assert by_kind["by_kind"] == {
        "job": "0.180000",
        "warm": "0.060000",
        "idle": "0.040000",
        "tail": "0.080000",
    }
    assert by_kind["shares"]["warm"] == pytest.approx(1 / 6, abs=1e-3)
    by_config = {r["key"]: r for r in _get(world, "viewer", url + "&group_by=config").json()["results"]}
    assert by_config["unit"]["job"] == "0.120000" and by_config["lint"]["job"] == "0.060000"
    assert by_config[None]["total"] == "0.180000"  # warm + idle + tail: no configuration ran then
    by_pool = _get(world, "viewer", url + "&group_by=pool").json()["results"]
    assert [(r["key"], r["total"]) for r in by_pool] == [("ci", "0.360000")]
    days = _get(world, "viewer", url + "&group_by=day").json()["results"]
    assert sum(Decimal(r["total"]) for r in days) == Decimal("0.36")
    # the other org sees none of it
    assert _get(world, "outsider", url).json()["total"] == "0.000000"


def test_job_and_instance_detail_show_their_cost(world: World, history: dict) -> None:
    job = _get(world, "viewer", f"/api/v1/jobs/{history['a'].pk}/").json()
    assert job["cost"]["amount"] == "0.120000" and job["cost"]["currency"] == "USD"
    detail = _get(world, "viewer", f"/api/v1/instances/{history['machine'].pk}/").json()["cost_detail"]
    assert detail["cost"] == "0.360000" and detail["live"] is False
    assert detail["jobs"] == {str(history["a"].pk): "0.120000", str(history["b"].pk): "0.060000"}
    assert _get(world, "outsider", f"/api/v1/jobs/{history['a'].pk}/").status_code == 404


def test_a_live_machine_shows_committed_and_accrued(world: World) -> None:
    m = idle_machine(world.org, world.machine_type)  # 0.01/h, hourly, just started
    MachineInstance.objects.filter(pk=m.pk).update(
        provisioning_started_at=timezone.now() - timedelta(minutes=30)
    )
    detail = _get(world, "viewer", f"/api/v1/instances/{m.pk}/").json()["cost_detail"]
    assert detail["live"] is True
    assert detail["cost"] == "0.010000"  # committed: the whole started hour
    assert Decimal("0.004") < Decimal(detail["accrued"]) < Decimal("0.006")  # about half of it


def test_this_months_costs_are_the_same_money_by_default_and_with_its_dates(world: World) -> None:
    """The default window ended at now, and a live machine's committed tail starts at now: the
    default answer left out every live machine's tail (0.0487 against 0.1425 on make dev)."""
    from apps.machines.budgets import period_start

    now = timezone.now()
    first = period_start("month", now)
    following = (first + timedelta(days=32)).replace(day=1)
    m = idle_machine(world.org, world.machine_type)  # 0.01/h, hourly
    started = max(first + timedelta(seconds=1), now - timedelta(minutes=30))
    MachineInstance.objects.filter(pk=m.pk).update(provisioning_started_at=started)
    default = _get(world, "viewer", "/api/v1/costs/").json()
    explicit = _get(world, "viewer", f"/api/v1/costs/?from={first.date()}&to={following.date()}").json()
    assert default["total"] == explicit["total"] == "0.010000"  # the whole started hour, committed
    assert default["by_kind"] == explicit["by_kind"]
    assert (default["from"], default["to"]) == (explicit["from"], explicit["to"])


def test_bad_cost_queries_answer_400_with_a_code(world: World) -> None:
    for query in (
        "group_by=week",
        "from=yesterday",
        "from=2026-02-30",
        "from=2026-11-02&to=2026-11-01",
        "from=2020-01-01&to=2026-01-01",
    ):
        response = _get(world, "viewer", f"/api/v1/costs/?{query}")
        assert response.status_code == 400, query
        assert response.json()["code"] in ("invalid", "invalid_range")


def test_export_costs_csv_sums_to_the_billed_cost(world: World, history: dict) -> None:
    out = io.StringIO()
    day = history["t0"].date()
    call_command(
        "export_costs",
        "--org",
        "acme",
        "--from",
        str(day - timedelta(days=1)),
        "--to",
        str(day + timedelta(days=2)),
        stdout=out,
    )
    rows = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert sum(Decimal(r["amount"]) for r in rows) == Decimal("0.36")
    assert {r["kind"] for r in rows} == {"job", "warm", "idle", "tail"}
    assert {r["config"] for r in rows if r["kind"] == "job"} == {"unit", "lint"}


def test_real_services_attribute_a_job_and_parts_sum_to_the_recorded_cost(world: World) -> None:
    # Given a job run through the scheduler and the agent's reports on an idle machine
    mt = world.machine_type
    m = idle_machine(world.org, mt)
    cfg = JobConfiguration.objects.create(org=world.org, name="build", machine_type=mt, command="x")
    job = job_submit(org=world.org, config=cfg)
    schedule()
    job_started(instance=m, job_id=job.pk)
    job_finished(instance=m, job_id=job.pk, outcome="succeeded", exit_code=0)
    instance_terminate(instance_id=m.pk, actor="test", reason="done")
    INSTANCE_STATES.move(m.pk, to=S.TERMINATED, from_=[S.TERMINATING], actor="test")
    refresh(m)
    # Then the job has a share and the machine's parts sum to the cost it recorded
    detail = _get(world, "viewer", f"/api/v1/instances/{m.pk}/").json()["cost_detail"]
    assert Decimal(detail["cost"]) == m.cost == Decimal("0.010000")
    assert sum(Decimal(v) for v in detail["by_kind"].values()) == m.cost
    assert list(detail["jobs"]) == [str(job.pk)]
    assert Decimal(_get(world, "viewer", f"/api/v1/jobs/{job.pk}/").json()["cost"]["amount"]) >= 0


def test_budgets_over_the_api(world: World) -> None:
    admin, viewer = world.client("admin"), world.client("viewer")
    created = admin.post("/api/v1/budgets/", {"amount": "100.00", "period": "month"}, format="json")
    assert created.status_code == 201, created.content
    assert created.json()["currency"] == "USD" and created.json()["spend"] == "0.00"
    raised = admin.post("/api/v1/budgets/", {"amount": "150"}, format="json")
    assert raised.json()["id"] == created.json()["id"] and raised.json()["amount"] == "150.00"
    assert viewer.post("/api/v1/budgets/", {"amount": "1"}, format="json").status_code == 403
    bad = admin.post("/api/v1/budgets/", {"amount": "-1"}, format="json")
    assert bad.status_code == 400 and bad.json()["code"] == "invalid"
    bad = admin.post("/api/v1/budgets/", {"amount": "5", "machine_type": "nope"}, format="json")
    assert bad.status_code == 400
    assert [b["amount"] for b in viewer.get("/api/v1/budgets/").json()["results"]] == ["150.00"]
    assert world.client("outsider").get("/api/v1/budgets/").json()["count"] == 0


def test_the_console_shows_cost_per_org_per_day_as_a_chart(world: World, history: dict) -> None:
    from django.contrib.auth import get_user_model
    from django.test import Client

    get_user_model().objects.create_superuser("ops", password="a-long-ops-password")
    client = Client()
    client.login(username="ops", password="a-long-ops-password")
    page = client.get("/admin/machines/budget/costs/?days=7")
    assert page.status_code == 200
    html = page.content.decode()
    assert "acme" in html and "<svg" in html and "total 0.36 USD" in html
    # the warm, idle and tail shares and amounts are visible, tail (800 unused seconds) beside idle
    assert "warm <b>16.7%</b> (0.0600)" in html and "idle <b>11.1%</b> (0.0400)" in html
    assert "tail, paid and unused <b>22.2%</b> (0.0800)" in html
    assert client.get("/admin/machines/budget/costs/?days=nonsense").status_code == 200
    assert "Cost per day (chart)" in client.get("/admin/machines/budget/").content.decode()
