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


# Ways a job printed its secret past the mask (issue 26), each a shell line over $API_KEY.
BYPASSES = {
    "split across stdout and stderr": 'printf "k=%s" "${API_KEY%????????}"; sleep 0.2; '
    'printf "%s\\n" "${API_KEY#${API_KEY%????????}}" >&2',
    "an ANSI code inside": 'printf "%s\\033[31m%s\\033[0m\\n" '
    '"${API_KEY%????????}" "${API_KEY#${API_KEY%????????}}"',
    "upper-cased": 'echo "$API_KEY" | tr a-z A-Z',
    "hex": 'printf %s "$API_KEY" | od -An -tx1',
    "hex, one line": 'printf %s "$API_KEY" | od -An -tx1 | tr -d " \\n"',
    "base64": 'printf %s "$API_KEY" | base64',
    "base64 inside a longer text": 'printf "xy%s" "$API_KEY" | base64',
    "spaced": 'echo "$API_KEY" | sed "s/./& /g"',
    "fold -w 3": 'echo "$API_KEY" | fold -w 3',
    "rev": 'echo "$API_KEY" | rev',  # util-linux (bsdextrautils on Debian 12)
    "URL-encoded": 'python3 -c "import os, urllib.parse; '
    "print(urllib.parse.quote(os.environ['URL_KEY'], safe=''))\"",
}
URL_SECRET = "p@ss/w0rd+Zq9#x!"


def _flat(text: str) -> str:
    """The output as a reader would take it in: no whitespace, no colour codes, lower case."""
    import re

    return re.sub(r"\s|\x1b\[[0-9;]*m", "", text).lower()


@pytest.mark.parametrize("how", list(BYPASSES))
def test_a_secret_printed_in_another_form_is_masked(api: object, start_agent: object, how: str) -> None:
    import base64
    from urllib.parse import quote

    from tests.agent.fake_server import FakeAgentAPI

    assert isinstance(api, FakeAgentAPI)
    start_agent()  # type: ignore[operator]
    job = api.assign(
        BYPASSES[how] + "; sleep 0.2; echo done",  # after the last piece has been read
        env={"API_KEY": CONFIG_SECRET, "URL_KEY": URL_SECRET},
        secret_env_names=["API_KEY", "URL_KEY"],
    )
    assert api.wait_finished(job)["outcome"] == "succeeded"
    output = api.output(job)
    flat = _flat(output)
    raw = CONFIG_SECRET.encode()
    forms = {
        CONFIG_SECRET.lower(),
        CONFIG_SECRET[::-1].lower(),
        raw.hex(),
        base64.b64encode(raw).decode().rstrip("=").lower(),
        base64.b64encode(b"xy" + raw).decode()[4:-4].lower(),  # the part that is the secret's alone
        quote(URL_SECRET, safe="").lower(),
    }
    leaked = sorted(form for form in forms if form in flat)
    assert not leaked, f"{how}: {leaked} in {output!r}"
    assert "***" in output and "done" in output


@pytest.mark.django_db
def test_a_secret_used_as_an_output_name_is_masked_for_viewers(
    world: World, tmp_path: object, local_storage: None
) -> None:
    """Viewers list a job's outputs (names) but may not read its env: a file named after the
    secret showed it to them."""
    from tests.jobs.test_artifacts import put, running_job

    job, agent, _ = running_job(world, tmp_path)  # type: ignore[arg-type]
    job.secret_env = {"API_KEY": JOB_SECRET}
    job.save(update_fields=["secret_env_encrypted"])
    base = f"/api/agent/v1/jobs/{job.pk}"
    assert put(agent, f"{base}/artifacts/dump-{JOB_SECRET}.txt", b"x").status_code == 201
    assert (
        put(
            agent, f"{base}/artifacts/{JOB_SECRET.upper()}%2Fhex-{JOB_SECRET.encode().hex()}", b"y"
        ).status_code
        == 201
    )
    failed = {"failed": [{"name": f"big-{JOB_SECRET}.bin", "error": f"too large: big-{JOB_SECRET}.bin"}]}
    assert agent.post(f"{base}/uploads-done", failed, format="json").status_code == 200
    listed = world.client("viewer").get(f"/api/v1/jobs/{job.pk}/artifacts/").json()
    names = sorted(a["name"] for a in listed)
    assert names == ["***/hex-***", "big-***.bin", "dump-***.txt"], names
    assert JOB_SECRET not in json.dumps(listed) and JOB_SECRET not in everything_stored()
