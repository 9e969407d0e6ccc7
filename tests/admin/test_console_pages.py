"""Console pages that answer an operator's questions, and writes that go through the services."""

from __future__ import annotations

import hashlib
import io
import re
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.conf import settings
from django.contrib import admin
from django.test import Client
from django.utils import timezone

import catacloud
from apps.events.models import Event
from apps.events.services import event_record
from apps.jobs.artifacts import artifact_store
from apps.jobs.models import Job, JobConfiguration, JobLogChunk
from apps.machines.costs import job_cost
from apps.machines.models import MachineInstance, MachineType, OrgMachineType, ProviderAccount
from apps.orgs.models import ApiToken, Membership
from testkit.builders import instance_row, job_config, job_row, pool_row
from tests.conftest import World

pytestmark = pytest.mark.django_db


def ran_job(world: World, *, status: str = "running") -> Job:
    """A job that waited 90 s, has run 5 minutes on a claimed machine, was requeued once."""
    now = timezone.now()
    config = JobConfiguration.objects.create(
        org=world.org, name="train", machine_type=world.machine_type, command="python train.py"
    )
    instance = instance_row(
        world.org,
        world.machine_type,
        status="claimed",
        provider_id="local-7",
        provisioning_started_at=now - timedelta(minutes=10),
    )
    job = Job.objects.create(
        org=world.org,
        config=config,
        machine_type=world.machine_type,
        command="python train.py",
        env={"EPOCHS": "3"},
        status=status,
        instance=instance,
        attempt=2,
    )
    job.secret_env = {"API_KEY": "hunter2-very-secret"}
    job.save()
    Job.objects.filter(pk=job.pk).update(
        created_at=now - timedelta(minutes=6, seconds=30),
        queued_at=now - timedelta(minutes=6, seconds=30),
        admitted_at=now - timedelta(minutes=6),
        started_at=now - timedelta(minutes=5),
    )
    event_record(
        kind="job.requeued",
        org=world.org,
        job=job,
        reason="machine_lost: agent silent for 90s",
        attempt=2,
        counts=True,
    )
    claim = event_record(kind="pool.member_claimed", org=world.org, instance=instance, job=job)
    Event.objects.filter(pk=claim.pk).update(created_at=now - timedelta(minutes=5, seconds=10))
    for seq, (stream, text) in enumerate(
        [("stdout", "epoch 1 loss 0.9\n"), ("stderr", "warning: slow disk\n")]
    ):
        JobLogChunk.objects.create(job=job, attempt=2, seq=seq, stream=stream, data=text)
    job.refresh_from_db()
    return job


def test_the_job_page_answers_what_happened_and_offers_cancel(
    world: World, ops: Client, local_storage: None
) -> None:
    job = ran_job(world)
    data = b"accuracy,0.93\n"
    artifact_store(
        job=job, kind="output", name="metrics.csv", body=io.BytesIO(data), size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
    )  # fmt: skip

    page = ops.get(f"/admin/jobs/job/{job.pk}/change/")

    assert page.status_code == 200
    html = page.content.decode()
    assert re.search(r"waited 1m 3[01]s \(queued → started\)", html)
    assert "ran 5m 0" in html
    assert "attempt <b>2</b> of at most 3" in html
    assert "machine_lost: agent silent for 90s" in html
    assert "epoch 1 loss 0.9" in html and '<span class="stderr">warning: slow disk' in html
    assert "metrics.csv" in html
    # its share of the machine it holds: 5 of the 10 minutes the paid hour has run so far
    assert re.search(
        rf"0\.00[0-9]+ {settings.CATACLOUD_CURRENCY} \(its share of: {str(job.instance_id)[:8]}", html
    )
    assert f"0.0000 {settings.CATACLOUD_CURRENCY}" not in html
    assert "EPOCHS" in html and "API_KEY" in html
    assert "hunter2" not in html  # secret env: names only
    # a record: no Save, no Delete; one action: cancel
    assert 'name="_save"' not in html and "deletelink" not in html
    assert 'id="cc-cancel-job"' in html
    # the artifact link downloads the file
    link = re.search(r'href="(/admin/jobs/job/[^"]+/artifacts/[^"]+/)"', html).group(1)
    download = ops.get(link)
    assert b"".join(download.streaming_content) == data
    # the whole log of the attempt
    assert ops.get(f"/admin/jobs/job/{job.pk}/log/?attempt=2").content.decode() == (
        "epoch 1 loss 0.9\nwarning: slow disk\n"
    )

    response = ops.post(f"/admin/jobs/job/{job.pk}/cancel/", follow=True)
    assert "cancel requested: the agent stops it" in response.content.decode()
    job.refresh_from_db()
    assert job.cancel_requested
    assert Event.objects.filter(kind="job.cancel_requested", job_id=job.pk, actor="admin:ops").exists()
    # a finished job has no cancel button, and cancelling it says why
    Job.objects.filter(pk=job.pk).update(status="succeeded", finished_at=timezone.now())
    assert 'id="cc-cancel-job"' not in ops.get(f"/admin/jobs/job/{job.pk}/change/").content.decode()
    response = ops.post(f"/admin/jobs/job/{job.pk}/cancel/", follow=True)
    assert "Not cancelled: Job" in response.content.decode()
    # and it cannot be deleted from the console
    assert ops.post(f"/admin/jobs/job/{job.pk}/delete/", {"post": "yes"}).status_code == 403
    assert Job.objects.filter(pk=job.pk).exists()


def test_lists_show_short_ids_age_heartbeat_cost_and_seconds(world: World, ops: Client) -> None:
    now = timezone.now()
    live = instance_row(
        world.org,
        world.machine_type,
        status="ready",
        provisioning_started_at=now - timedelta(minutes=30),
        last_heartbeat_at=now - timedelta(seconds=12),
    )
    ended = instance_row(world.org, world.machine_type, status="terminated", cost="0.010000")
    html = ops.get("/admin/machines/machineinstance/").content.decode()
    assert f'title="{live.pk}">{str(live.pk)[:8]}</code>' in html
    assert f">{live.pk}<" not in html  # the whole UUID only in the tooltip
    assert "12s ago" in html or "13s ago" in html
    assert "0.0100" in html  # ended: its billed cost; live: committed so far (one paid hour)
    assert re.search(r"created \d{4}-\d\d-\d\d \d\d:\d\d:\d\d", html)  # to the second
    assert "icon-no.svg" not in html and "outdated</span>" not in html  # False is not an error
    MachineInstance.objects.filter(pk=live.pk).update(outdated=True)
    assert "outdated</span>" in ops.get("/admin/machines/machineinstance/").content.decode()
    accounts = ops.get("/admin/machines/provideraccount/").content.decode()
    assert '<span class="cc-muted">no</span>' in accounts and "icon-no.svg" not in accounts
    assert ended.pk


def test_quota_usage_is_shown_next_to_every_limit(world: World, ops: Client) -> None:
    for _ in range(3):
        instance_row(world.org, world.machine_type, status="ready")
    html = ops.get("/admin/machines/orgmachinetype/").content.decode()
    assert "machines 3/20" in html and "jobs 0/10" in html
    org_page = ops.get(f"/admin/orgs/organization/{world.org.pk}/change/").content.decode()
    assert "machines 3/20" in org_page and "in use / limit" in org_page


def grant_inline_post(world: World, **overrides: object) -> dict:
    grant = world.grant
    data = {
        "slug": world.org.slug,
        "name": world.org.name,
        "memberships-TOTAL_FORMS": 0,
        "memberships-INITIAL_FORMS": 0,
        "machine_type_grants-TOTAL_FORMS": 1,
        "machine_type_grants-INITIAL_FORMS": 1,
        "machine_type_grants-0-id": grant.pk,
        "machine_type_grants-0-org": world.org.pk,
        "machine_type_grants-0-machine_type": world.machine_type.pk,
        "machine_type_grants-0-max_concurrent_jobs": 10,
        "machine_type_grants-0-max_instances": 20,
        "machine_type_grants-0-max_pool_size": 10,
        "machine_type_grants-0-policy": "speed",
        "machine_type_grants-0-max_wait_seconds": 90,
    }
    data.update({f"machine_type_grants-0-{k}": v for k, v in overrides.items()})
    return data


def test_org_page_writes_grants_through_the_service_and_refuses_deleting_one_in_use(
    world: World, ops: Client
) -> None:
    url = f"/admin/orgs/organization/{world.org.pk}/change/"
    response = ops.post(url, grant_inline_post(world, max_instances=5))
    assert response.status_code == 302
    world.grant.refresh_from_db()
    assert world.grant.max_instances == 5
    assert Event.objects.filter(kind="org.grant_updated", org=world.org, data__max_instances=5).exists()

    pool_row(world.org, world.machine_type, status="ready")
    response = ops.post(url, grant_inline_post(world, DELETE="on"))
    assert response.status_code == 200
    assert "is still in use (1 pools)" in response.content.decode()
    assert OrgMachineType.objects.filter(pk=world.grant.pk).exists()


def test_memberships_are_set_and_removed_through_the_services(world: World, ops: Client) -> None:
    member = Membership.objects.get(org=world.org, user=world.users["member"])
    response = ops.post(f"/admin/orgs/membership/{member.pk}/change/", {"role": "viewer"})
    assert response.status_code == 302
    assert Event.objects.filter(kind="org.member_set", org=world.org, data__role="viewer").exists()
    response = ops.post(f"/admin/orgs/membership/{member.pk}/delete/", {"post": "yes"})
    assert response.status_code == 302
    assert not Membership.objects.filter(pk=member.pk).exists()
    # the member's tokens in that org stop working with the membership
    assert not ApiToken.objects.filter(user=world.users["member"], revoked_at__isnull=True).exists()
    assert Event.objects.filter(kind="org.member_removed", data__tokens_revoked=1).exists()


def test_renaming_a_provider_account_keeps_the_account(world: World, ops: Client) -> None:
    response = ops.post(
        f"/admin/machines/provideraccount/{world.account.pk}/change/",
        {"name": "local-renamed", "config": '{"state_dir": "/tmp/x"}', "new_credentials": ""},
    )
    assert response.status_code == 302
    assert list(ProviderAccount.objects.values_list("pk", "name")) == [(world.account.pk, "local-renamed")]
    event = Event.objects.get(kind="provider_account.updated")
    assert event.data["renamed_from"] == "local" and event.actor == "admin:ops"


def machine_type_post(world: World, **changes: object) -> dict:
    mt = world.machine_type
    data = {
        "name": mt.name,
        "description": "",
        "provider_account": world.account.pk,
        "server_type": mt.server_type,
        "location": "",
        "image": "",
        "cpus": mt.cpus,
        "memory_mb": mt.memory_mb,
        "gpus": 0,
        "price_per_hour": "0.01",
        "billing_increment_seconds": 3600,
        "min_billed_seconds": 0,
        "required_privilege": "",
        "disk_gb": "",
        "network": "{}",  # what the form shows for a machine type that allows nothing more
        "image_cache_mb": mt.image_cache_mb,
        "alternatives": "[]",
        "arch": mt.arch,  # the form shows it filled (x86_64 by default)
        "labels": "{}",
    }
    data.update(changes)
    return data


def test_machine_type_edits_bump_the_version_in_the_service(world: World, ops: Client) -> None:
    url = f"/admin/machines/machinetype/{world.machine_type.pk}/change/"
    assert (
        ops.post(url, machine_type_post(world, description="price only", price_per_hour="0.02")).status_code
        == 302
    )
    world.machine_type.refresh_from_db()
    assert world.machine_type.version == 1  # price and description do not change the machines
    assert ops.post(url, machine_type_post(world, name="small-v2", cpus=4)).status_code == 302
    assert MachineType.objects.count() == 1  # renamed in place
    mt = MachineType.objects.get()
    assert (mt.name, mt.cpus, mt.version) == ("small-v2", 4, 2)
    assert Event.objects.filter(kind="machine_type.updated", data__version=2, actor="admin:ops").exists()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"alternatives": '"cx33"'}, "must be a list of machine type names"),
        ({"arch": "sparc"}, "one of x86_64, arm64"),
        ({"labels": '["gpu"]'}, "must be an object of strings"),
    ],
)
def test_a_machine_type_with_a_bad_candidate_field_is_refused_with_a_message(
    world: World, ops: Client, change: dict, message: str
) -> None:
    url = f"/admin/machines/machinetype/{world.machine_type.pk}/change/"
    response = ops.post(url, machine_type_post(world, description="changed", **change))
    assert response.status_code == 200 and message in response.content.decode()
    world.machine_type.refresh_from_db()
    assert world.machine_type.description != "changed"  # nothing written


def test_a_job_configuration_with_a_bad_env_is_refused_with_a_message(world: World, ops: Client) -> None:
    response = ops.post(
        "/admin/jobs/jobconfiguration/add/",
        {
            "org": world.org.pk,
            "name": "bad",
            "machine_type": world.machine_type.pk,
            "command": "true",
            "env": '{"CATACLOUD_X": "1"}',
            "timeout_seconds": 60,
            "priority": 0,
            "max_attempts": 1,
            "reuse": "reuse",
            "artifact_retention_days": 7,
        },
    )
    assert response.status_code == 200
    assert "CATACLOUD_X is reserved" in response.content.decode()
    assert not JobConfiguration.objects.filter(name="bad").exists()
    assert not Event.objects.filter(kind="job_config.created").exists()


def test_privileges_and_schedules_are_checked_and_recorded(world: World, ops: Client) -> None:
    from apps.orgs.models import Privilege

    gpu = Privilege.objects.create(name="gpu")
    data = {
        "slug": world.org.slug,
        "name": world.org.name,
        "privileges": [gpu.pk],
        "memberships-TOTAL_FORMS": 0,
        "memberships-INITIAL_FORMS": 0,
        "machine_type_grants-TOTAL_FORMS": 0,
        "machine_type_grants-INITIAL_FORMS": 0,
    }
    url = f"/admin/orgs/organization/{world.org.pk}/change/"
    assert ops.post(url, data).status_code == 302
    assert Event.objects.filter(kind="org.privilege_granted", org=world.org, actor="admin:ops").exists()
    assert ops.post(url, {**data, "privileges": []}).status_code == 302
    assert not world.org.privileges.exists()
    assert Event.objects.filter(kind="org.privilege_revoked", org=world.org).exists()

    pool = pool_row(world.org, world.machine_type, max_size=2, status="ready")
    response = ops.post(
        f"/admin/pools/instancepool/{pool.pk}/change/",
        {
            "name": "p",
            "description": "",
            "target_size": 1,
            "min_size": 0,
            "max_size": 2,
            "warmup_grace_seconds": 600,
            "schedules-TOTAL_FORMS": 1,
            "schedules-INITIAL_FORMS": 0,
            "schedules-0-name": "mornings",
            "schedules-0-cron": "every morning",
            "schedules-0-timezone": "Mars/Olympus",
            "schedules-0-target_size": 2,
            "members-TOTAL_FORMS": 0,
            "members-INITIAL_FORMS": 0,
        },
    )
    assert response.status_code == 200
    html = response.content.decode()
    assert "is not a cron expression" in html and "unknown time zone" in html
    assert not pool.schedules.exists()


def test_moving_a_membership_row_to_another_user_removes_the_first(world: World, ops: Client) -> None:
    rows = list(Membership.objects.filter(org=world.org).order_by("user__username"))
    data = {
        "slug": world.org.slug,
        "name": world.org.name,
        "memberships-TOTAL_FORMS": len(rows),
        "memberships-INITIAL_FORMS": len(rows),
        "machine_type_grants-TOTAL_FORMS": 0,
        "machine_type_grants-INITIAL_FORMS": 0,
    }
    for i, m in enumerate(rows):
        user = world.users["outsider"] if m.user == world.users["member"] else m.user
        data.update(
            {
                f"memberships-{i}-id": m.pk,
                f"memberships-{i}-org": world.org.pk,
                f"memberships-{i}-user": user.pk,
                f"memberships-{i}-role": m.role,
            }
        )
    response = ops.post(f"/admin/orgs/organization/{world.org.pk}/change/", data)
    assert response.status_code == 302
    members = set(Membership.objects.filter(org=world.org).values_list("user__username", "role"))
    assert members == {("admin", "admin"), ("outsider", "member"), ("viewer", "viewer")}
    assert Event.objects.filter(kind="org.member_removed", data__user="member").exists()
    assert Event.objects.filter(kind="org.member_set", data__user="outsider", actor="admin:ops").exists()


def test_a_job_configuration_is_edited_through_the_service(world: World, ops: Client) -> None:
    config = JobConfiguration.objects.create(
        org=world.org, name="nightly", machine_type=world.machine_type, command="make"
    )
    form = {
        "name": "nightly",
        "machine_type": world.machine_type.pk,
        "command": "make test",
        "env": '{"LEVEL": "2"}',
        "timeout_seconds": 600,
        "priority": 1,
        "max_attempts": 2,
        "reuse": "reuse",
        "artifact_retention_days": 7,
    }
    response = ops.post(f"/admin/jobs/jobconfiguration/{config.pk}/change/", form)
    assert response.status_code == 302
    config.refresh_from_db()
    assert (config.command, config.env, config.org_id) == ("make test", {"LEVEL": "2"}, world.org.pk)
    assert list(Event.objects.filter(kind__startswith="job_config.").values_list("kind", "actor")) == [
        ("job_config.updated", "admin:ops")
    ]


def test_the_home_page_groups_what_an_operator_looks_for_and_leads_nowhere_broken(
    world: World, ops: Client
) -> None:
    """Budgets sat under Machines, heartbeats and installations under "Core" with nothing to say
    what they are; Auth and Core once sat above the fleet; "View site" led to a debug 404."""
    page = ops.get("/admin/")
    groups = {app["name"]: [m["name"] for m in app["models"]] for app in page.context["app_list"]}
    assert list(groups) == [
        "Fleet",
        "Jobs",
        "Costs",
        "GitHub Actions",
        "GitLab CI",
        "Organizations and access",
        "Records and the system",
    ], list(groups)
    assert groups["Fleet"][:2] == ["Machines", "Pools"]
    assert groups["Costs"] == ["Cost per day", "Budgets"]
    assert "Machine type grants and quotas" in groups["Organizations and access"]
    assert groups["Records and the system"] == ["Events", "Service heartbeats", "Installation identity"]
    # every model the console registers is listed exactly once
    listed = [m["admin_url"] for app in page.context["app_list"] for m in app["models"]]
    assert len(listed) == len(set(listed)) == len(admin.site._registry) + 1  # + the cost chart
    html = page.content.decode()
    assert "when Celery beat" in html and "the label on every cloud machine" in html  # what they are
    assert 'href="/admin/machines/budget/costs/"' in html
    assert "View site" not in html
    assert ops.get("/admin/machines/").status_code == 200  # an app's own page still lists its models
    root = ops.get("/")
    assert root.status_code == 302 and root["Location"] == "/admin/"


def test_every_console_page_names_the_control_planes_version(
    world: World, ops: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(catacloud, "__version__", "9.8.7-test")
    for path in ("/admin/", "/admin/dashboard/", "/admin/jobs/job/", "/admin/machines/budget/costs/"):
        html = ops.get(path).content.decode()
        assert '<span id="cc-version">9.8.7-test</span>' in html, path
    assert "9.8.7-test" in Client().get("/admin/login/").content.decode()  # before logging in too


def test_terminated_machines_are_left_out_of_the_list_unless_asked_for(world: World, ops: Client) -> None:
    now = timezone.now()
    rows = {
        status: instance_row(world.org, world.machine_type, status=status, provisioning_started_at=now)
        for status in ("ready", "failed", "terminated")
    }
    for _ in range(3):  # ended machines pile up: one per job on a fleet that does not reuse
        instance_row(world.org, world.machine_type, status="terminated", cost="0.010000")

    def listed(query: str = "") -> set[str]:
        page = ops.get(f"/admin/machines/machineinstance/{query}")
        return {str(pk) for pk in page.context["cl"].result_list.values_list("pk", flat=True)}

    assert listed() == {str(rows["ready"].pk), str(rows["failed"].pk)}
    html = ops.get("/admin/machines/machineinstance/").content.decode()
    assert "not terminated" in html and "?status=terminated" in html  # the filter, on the right
    assert listed("?status=terminated") == {
        str(pk) for pk in MachineInstance.objects.filter(status="terminated").values_list("pk", flat=True)
    }
    assert listed("?status=live") == {str(rows["ready"].pk)}
    assert len(listed("?status=all")) == 6
    assert listed(f"?q={rows['terminated'].pk}") == {str(rows["terminated"].pk)}  # a search finds it


def claimed_for(instance: MachineInstance, job: Job | None, start: datetime, end: datetime) -> None:
    """The events of a hold: the machine claimed (for ``job``) at ``start``, released at ``end``."""
    claim = event_record(kind="instance.claimed", org=instance.org_id, instance=instance, job=job)
    release = event_record(kind="instance.released", org=instance.org_id, instance=instance, job=job)
    Event.objects.filter(pk=claim.pk).update(created_at=start)
    Event.objects.filter(pk=release.pk).update(created_at=end)


def short_job(world: World) -> Job:
    """A job of the org ``rival`` that ran 3 seconds on a machine billed by the hour at 0.01 (its
    share: 0.000008), which ended since."""
    now = timezone.now()
    org = world.other_org
    config = JobConfiguration.objects.create(
        org=org, name="lint", machine_type=world.machine_type, command="ruff check"
    )
    machine = instance_row(
        org,
        world.machine_type,
        status="terminated",
        provisioning_started_at=now - timedelta(minutes=2),
        ended_at=now - timedelta(seconds=30),
        cost="0.010000",
    )
    job = Job.objects.create(
        org=org,
        config=config,
        machine_type=world.machine_type,
        command="ruff check",
        status="succeeded",
        instance=machine,
        exit_code=0,
    )
    claimed_for(machine, job, now - timedelta(seconds=63), now - timedelta(seconds=60))
    return job


def test_a_short_jobs_cost_is_shown_with_its_first_digits_not_as_zero(world: World, ops: Client) -> None:
    job = short_job(world)
    amount = Decimal(job_cost(job, now=timezone.now())["amount"])
    assert Decimal("0.000007") <= amount <= Decimal("0.000009")  # 3 s of a 0.01 hour
    html = ops.get(f"/admin/jobs/job/{job.pk}/change/").content.decode()
    assert (
        f"{amount} {settings.CATACLOUD_CURRENCY} (its share of: {str(job.instance_id)[:8]} {amount})" in html
    )
    assert f"0.0000 {settings.CATACLOUD_CURRENCY}" not in html
    machine = ops.get(f"/admin/machines/machineinstance/{job.instance_id}/change/").content.decode()
    assert re.search(r"job 0\.00000[1-9]", machine), machine  # its parts on the machine's page too


def paid_but_unused(world: World) -> None:
    """Two machines of the 0.01-an-hour type, billed by the hour, that ended in the last hour:

    - one lived 12 minutes: a job held it 5 of them, it sat idle 7 (kept for reuse); the 48
      minutes it paid for and never lived are its tail;
    - one lived 6 minutes, all of them idle (booted for a job that went elsewhere); tail 54.

    Of the 120 paid minutes: job 5 (4.2 %), idle 13 (10.8 %), tail 102 (85.0 %)."""
    now = timezone.now()
    for minutes, lived, hold in ((50, 12, (2, 7)), (30, 6, None)):
        start = now - timedelta(minutes=minutes)
        machine = instance_row(
            world.org,
            world.machine_type,
            status="terminated",
            provisioning_started_at=start,
            ended_at=start + timedelta(minutes=lived),
            cost="0.010000",
        )
        if hold:
            claimed_for(machine, None, start + timedelta(minutes=hold[0]), start + timedelta(minutes=hold[1]))


def test_the_cost_views_show_the_unused_paid_tail_beside_idle(world: World, ops: Client) -> None:
    """A demo's spend was 98.9 % tail while the dashboard's idle share read 3-4 %: the tail was
    on no console page but the per-day chart, rounded to whole percents."""
    paid_but_unused(world)
    dashboard = ops.get("/admin/dashboard/").content.decode()
    costs = dashboard[dashboard.index('id="cc-costs"') :]
    assert "tail (paid, unused)" in costs
    assert re.search(r'class="cc-num cc-idle">10\.8% <small>\(0 idle now\)</small></td>\s*'
                     r'<td class="cc-num cc-tail">85\.0%</td>', costs), costs  # fmt: skip
    chart = ops.get("/admin/machines/budget/costs/").content.decode()
    assert "idle <b>10.8%</b> (0.0022)" in chart
    assert "tail, paid and unused <b>85.0%</b> (0.0170)" in chart


def ci_world(world: World) -> dict[str, Any]:
    """GitHub: an installation paused by GitHub's rate limit (twice today), a runner class with
    3 workflow jobs waiting (the oldest for 5 minutes), 1 running, a runner starting; a delivery
    stored but never acted on, one whose labels no class covers, one GitHub lost and sent again.
    GitLab: a connection that answers, a class with 1 pending job and 12 calls this hour."""
    from apps.github.models import (
        GitHubConnection,
        GitHubInstallation,
        Runner,
        RunnerClass,
        WebhookDelivery,
        WorkflowJob,
    )
    from apps.gitlab.models import GitLabConnection, GitLabJob, GitLabRunnerClass

    now = timezone.now()
    conn = GitHubConnection.objects.create(org=world.org, app_id=7)
    inst = GitHubInstallation.objects.create(
        connection=conn,
        org=world.org,
        installation_id=4242,
        account="acme-gh",
        unavailable_until=now + timedelta(minutes=3),
        unavailable_reason="rate limit exhausted (resets in 180s)",
        failures=1,
        rate_remaining=0,
        window_started_at=now - timedelta(minutes=10),
        window_calls=812,
    )
    for reason in (
        "rate limit exhausted (resets in 180s)",
        "GET /app: ConnectionError",
        "rate limited (429)",
    ):
        event_record(kind="github.unavailable", org=world.org, reason=reason, installation=4242, until="x")
    gh_class = RunnerClass.objects.create(
        org=world.org,
        name="linux-2cpu",
        labels=["catacloud-linux-2cpu", "self-hosted"],
        machine_type=world.machine_type,
    )
    runner_job = job_row(job_config(world.org, world.machine_type, "github-linux-2cpu", "run.sh"))
    Runner.objects.create(job=runner_job, installation=inst, runner_class=gh_class, org=world.org)
    for n, (status, age) in enumerate(
        [("queued", 300), ("queued", 20), ("queued", 5), ("in_progress", 60), ("completed", 90)]
    ):
        row = WorkflowJob.objects.create(
            installation=inst, org=world.org, runner_class=gh_class, github_id=100 + n, run_id=9,
            repository="acme/app", workflow="ci", name=f"test {n}", status=status,
        )  # fmt: skip
        WorkflowJob.objects.filter(pk=row.pk).update(seen_at=now - timedelta(seconds=age))
    for guid, outcome, processed, age in (
        ("d-late", "", False, 120),
        ("d-nomatch", "no runner class covers these labels", True, 30),
        ("d-ok", "created", True, 30),
    ):
        WebhookDelivery.objects.create(
            guid=guid, installation=inst, org=world.org, event="workflow_job", action="queued", payload={},
            processed_at=now if processed else None, outcome=outcome,
        )  # fmt: skip
        WebhookDelivery.objects.filter(pk=guid).update(received_at=now - timedelta(seconds=age))
    event_record(
        kind="github.redelivered", org=world.org, delivery="d-lost", event="workflow_job", action="queued"
    )
    gl = GitLabConnection.objects.create(
        org=world.org, window_started_at=now - timedelta(minutes=5), window_calls=12, rate_remaining=1990
    )
    gl_class = GitLabRunnerClass.objects.create(
        org=world.org, name="docker", tags=["catacloud", "docker"], machine_type=world.machine_type
    )
    GitLabJob.objects.create(
        connection=gl, org=world.org, runner_class=gl_class, gitlab_id=77, project_id=1, project="acme/web",
        status="pending",
    )  # fmt: skip
    return {"installation": inst, "github_class": gh_class, "gitlab_class": gl_class}


def test_the_dashboard_shows_each_ci_connection_its_limits_webhook_failures_and_backlog(
    world: World, ops: Client
) -> None:
    made = ci_world(world)
    html = ops.get("/admin/dashboard/").content.decode()
    ci = html[html.index('id="cc-ci"') : html.index('id="cc-throughput"')]
    github, gitlab = ci.split("GitHub · acme", 1)[1].split("GitLab · acme", 1)
    # GitHub: paused by its rate limit, our own budget's use, the day's limits, the webhook failures
    assert "installation 4242 (acme-gh)" in github
    assert "waiting until" in github and "rate limit exhausted (resets in 180s)" in github
    assert "812/4500" in github  # 90 % of the 5,000 GitHub grants an installation
    assert "2 limits, 3 pauses" in github
    assert "3 received: " in github
    assert "1 not acted on, 1 no class covers, 1 lost and sent again" in github
    # GitLab: it answers
    assert "available" in gitlab and "unavailable" not in gitlab.split("</tr>")[0]
    assert "12/36000" in gitlab
    # the backlog per runner class: waiting, the oldest wait, runners, running
    classes = html[html.index('id="cc-ci-classes"') :]
    row = classes.split("GitHub · acme/linux-2cpu", 1)[1].split("</tr>")[0]
    assert re.search(r"<b>3</b></td>\s*<td class=\"cc-num\">5m 0\ds</td>", row), row
    assert "catacloud-linux-2cpu, self-hosted" in row
    assert '<td class="cc-num">1 · 0</td><td class="cc-num">1</td>' in row  # 1 starting, 1 running
    gl_row = classes.split("GitLab · acme/docker", 1)[1].split("</tr>")[0]
    assert "<b>1</b>" in gl_row
    assert f'href="/admin/github/runnerclass/{made["github_class"].pk}/change/"' in classes
