"""Console pages that answer an operator's questions, and writes that go through the services."""

from __future__ import annotations

import hashlib
import io
import re
from datetime import timedelta

import pytest
from django.conf import settings
from django.test import Client
from django.utils import timezone

from apps.events.models import Event
from apps.events.services import event_record
from apps.jobs.artifacts import artifact_store
from apps.jobs.models import Job, JobConfiguration, JobLogChunk
from apps.machines.models import MachineInstance, MachineType, OrgMachineType, ProviderAccount
from apps.orgs.models import ApiToken, Membership
from testkit.builders import instance_row, pool_row
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


def test_the_home_page_lists_the_fleet_first_and_leads_nowhere_broken(world: World, ops: Client) -> None:
    """Auth and Core sat above Jobs, Machines and Pools; "View site" led to a debug 404."""
    page = ops.get("/admin/")
    apps = [app["app_label"] for app in page.context["app_list"]]
    assert apps[:3] == ["jobs", "machines", "pools"], apps
    assert apps.index("pools") < apps.index("core") < apps.index("auth") == len(apps) - 1
    assert "View site" not in page.content.decode()
    root = ops.get("/")
    assert root.status_code == 302 and root["Location"] == "/admin/"
