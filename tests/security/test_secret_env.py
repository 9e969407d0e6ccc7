"""Boundary: secret env values reach the job and nobody else.

Shown on main: there was no secret env; every env value was stored in clear, returned by the
API (to viewers too) and so visible to anyone who could read the job.
"""

from __future__ import annotations

import json

import pytest
from django.db import connection

from apps.jobs.models import Job
from apps.machines.models import MachineInstance
from testkit.builders import enrolled_agent
from tests.conftest import World

CONFIG_SECRET = "cfg-s3cret-value-1234"
JOB_SECRET = "job-s3cret-value-5678"


def everything_stored() -> str:
    """Every row of the tables that could hold it, as text."""
    with connection.cursor() as cursor:
        dump = []
        for table in ("jobs_jobconfiguration", "jobs_job", "events_event"):
            cursor.execute(f"SELECT * FROM {table}")
            dump.append(json.dumps(cursor.fetchall(), default=str))
    return "\n".join(dump)


@pytest.mark.django_db
def test_secret_env_reaches_the_job_and_is_never_returned_or_stored_in_clear(world: World) -> None:
    admin, member = world.client("admin"), world.client("member")
    created = admin.post(
        "/api/v1/job-configs/",
        {
            "name": "deploy",
            "machine_type": str(world.machine_type.pk),
            "command": "deploy.sh",
            "env": {"REGION": "eu"},
            "secret_env": {"API_KEY": CONFIG_SECRET},
        },
        format="json",
    )
    assert created.status_code == 201, created.content
    assert CONFIG_SECRET not in created.content.decode()
    assert created.json()["secret_env_keys"] == ["API_KEY"]

    submitted = member.post(
        "/api/v1/jobs/",
        {"config": created.json()["id"], "secret_env": {"DEPLOY_TOKEN": JOB_SECRET}},
        format="json",
    )
    assert submitted.status_code == 201, submitted.content
    job_id = submitted.json()["id"]
    assert submitted.json()["secret_env_keys"] == ["API_KEY", "DEPLOY_TOKEN"]

    config_url = f"/api/v1/job-configs/{created.json()['id']}/"
    for who in ("admin", "member", "viewer"):
        client = world.client(who)
        for url in (f"/api/v1/jobs/{job_id}/", "/api/v1/jobs/", config_url):
            text = client.get(url).content.decode()
            assert CONFIG_SECRET not in text and JOB_SECRET not in text, (who, url)
    stored = everything_stored()
    assert CONFIG_SECRET not in stored and JOB_SECRET not in stored

    # The job gets both, through its agent.
    agent, instance = enrolled_agent(world.org, world.machine_type)
    MachineInstance.objects.filter(pk=instance.pk).update(status="claimed")
    Job.objects.filter(pk=job_id).update(status="assigned", instance=instance)
    work = agent.get("/api/agent/v1/work?wait=0")
    assert work.status_code == 200
    env = work.json()["job"]["env"]
    assert env["API_KEY"] == CONFIG_SECRET and env["DEPLOY_TOKEN"] == JOB_SECRET and env["REGION"] == "eu"
    assert work.json()["job"]["secret_env_names"] == ["API_KEY", "DEPLOY_TOKEN"]


@pytest.mark.django_db
def test_secret_env_names_are_checked_like_env(world: World) -> None:
    response = world.client("admin").post(
        "/api/v1/job-configs/",
        {
            "name": "bad",
            "machine_type": str(world.machine_type.pk),
            "command": "x",
            "secret_env": {"CATACLOUD_JOB_TOKEN": "x"},
        },
        format="json",
    )
    assert response.status_code == 400 and response.json()["code"] == "invalid"


# ---- the job's output: secret values are masked by the agent ----------------------------------


def test_a_job_printing_its_secret_shows_stars(api: object, start_agent: object) -> None:
    from tests.agent.fake_server import FakeAgentAPI

    assert isinstance(api, FakeAgentAPI)
    start_agent()  # type: ignore[operator]
    job = api.assign(
        'echo "key=$API_KEY"; printf "split=%s" "${API_KEY%????????}"; sleep 0.3;'
        ' printf "%s\\n" "${API_KEY#${API_KEY%????????}}"; echo "plain=$REGION" >&2',
        env={"API_KEY": CONFIG_SECRET, "REGION": "eu"},
        secret_env_names=["API_KEY"],
    )
    assert api.wait_finished(job)["outcome"] == "succeeded"
    output = api.output(job)
    assert CONFIG_SECRET not in output
    assert "key=***" in output and "split=***" in output  # also when written in two pieces
    assert "plain=eu" in output
