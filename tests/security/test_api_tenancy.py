"""Boundary: an org's users see only their org, and only what their role may read.

Shown on main: ``?instance=<another org's id>`` answered 200 with 0 results while a random id
answered 400 (a filter told another tenant's objects exist); job and configuration ``env``
was shown to viewers and to job-scoped tokens; ``/metrics`` (every org and pool by name) was
open by default.
"""

from __future__ import annotations

import uuid

import pytest
from django.test import override_settings
from rest_framework.test import APIClient

from apps.jobs.models import Job, JobConfiguration
from apps.machines.models import MachineInstance
from apps.orgs.services import api_token_create
from tests.conftest import World

pytestmark = pytest.mark.django_db


def test_a_filter_answers_alike_for_another_orgs_id_and_a_random_one(world: World) -> None:
    theirs = MachineInstance.objects.create(
        org=world.other_org, machine_type=world.machine_type, provider_account=world.account, status="ready"
    )
    client = world.client("viewer")
    other = client.get(f"/api/v1/jobs/?instance={theirs.pk}")
    random = client.get(f"/api/v1/jobs/?instance={uuid.uuid4()}")
    assert other.status_code == random.status_code == 400
    assert other.json()["code"] == random.json()["code"] == "invalid"


def job_with_env(world: World) -> Job:
    config = JobConfiguration.objects.create(
        org=world.org,
        name="c",
        machine_type=world.machine_type,
        command="x",
        env={"REGION": "eu-central"},
    )
    return Job.objects.create(
        org=world.org,
        config=config,
        machine_type=world.machine_type,
        command="x",
        env={"REGION": "eu-central", "RUN_LABEL": "nightly"},
    )


def test_env_is_shown_to_members_and_hidden_from_viewers_and_job_tokens(world: World) -> None:
    job = job_with_env(world)
    _, job_secret = api_token_create(org=world.org, user=world.users["member"], scope=f"job:{job.pk}")
    job_token = APIClient()
    job_token.credentials(HTTP_AUTHORIZATION=f"Bearer {job_secret}")

    member = world.client("member").get(f"/api/v1/jobs/{job.pk}/").json()
    assert member["env"] == {"REGION": "eu-central", "RUN_LABEL": "nightly"}
    assert member["env_hidden"] is False
    assert world.client("member").get(f"/api/v1/job-configs/{job.config_id}/").json()["env"]

    for who, client in (("viewer", world.client("viewer")), ("job token", job_token)):
        body = client.get(f"/api/v1/jobs/{job.pk}/").json()
        assert body["env"] == {} and body["env_hidden"] is True, who
    listed = world.client("viewer").get("/api/v1/jobs/").json()["results"]
    assert listed and all(row["env"] == {} for row in listed)
    viewer_config = world.client("viewer").get(f"/api/v1/job-configs/{job.config_id}/").json()
    assert viewer_config["env"] == {} and viewer_config["env_hidden"] is True


@override_settings(CATACLOUD_METRICS_TOKEN="", CATACLOUD_METRICS_PUBLIC=False)
def test_metrics_are_closed_without_a_token() -> None:
    response = APIClient().get("/metrics")
    assert response.status_code == 403 and response.json()["code"] == "metrics_closed"
    assert b"acme" not in response.content


@override_settings(CATACLOUD_METRICS_TOKEN="scrape-me")
def test_metrics_need_the_token_when_one_is_set() -> None:
    assert APIClient().get("/metrics").status_code == 401
    assert APIClient().get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert APIClient().get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-me").status_code == 200


@override_settings(CATACLOUD_METRICS_TOKEN="", CATACLOUD_METRICS_PUBLIC=True)
def test_metrics_can_be_opened_on_purpose() -> None:
    assert APIClient().get("/metrics").status_code == 200
