"""Outputs and checkpoints: the stores (local and S3 through moto with the real boto3), the
Agent API uploads with their checks, the user API, tenancy and retention."""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from apps.jobs.artifacts import artifacts_expire, get_store
from apps.jobs.models import Artifact, Job, JobConfiguration, JobLogChunk
from apps.machines.models import MachineInstance
from catacloud.storage import LocalStore, S3Store, Store
from testkit.builders import enrolled_agent, job_config, job_row
from testkit.servers import moto_client, moto_server
from tests.conftest import World

# ---- the store contract, run against both stores ------------------------------------------------


@pytest.fixture(scope="module")
def moto_s3() -> Iterator[Any]:
    with moto_server() as url:
        client = moto_client("s3", url)
        client.create_bucket(Bucket="outputs")
        yield client


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    return S3Store(bucket="outputs", prefix="test", multipart_mb=5, client=request.getfixturevalue("moto_s3"))


def test_store_round_trip_byte_for_byte(store: Store) -> None:
    data = os.urandom(12 * 1024 * 1024 + 17)  # above the 5 MiB part size: a multipart upload on S3
    store.put("org/job/outputs/big.bin", io.BytesIO(data), size=len(data))
    assert store.size("org/job/outputs/big.bin") == len(data)
    assert b"".join(store.open("org/job/outputs/big.bin")) == data
    store.delete("org/job/outputs/big.bin")
    store.delete("org/job/outputs/big.bin")  # idempotent
    assert store.size("org/job/outputs/big.bin") is None
    with pytest.raises(FileNotFoundError):
        list(store.open("org/job/outputs/big.bin"))


def test_s3_multipart_really_used_and_presigned_urls(moto_s3: Any) -> None:
    store = S3Store(bucket="outputs", prefix="p", multipart_mb=5, client=moto_s3)
    data = os.urandom(11 * 1024 * 1024)
    store.put("o/j/b", io.BytesIO(data), size=len(data))
    head = moto_s3.head_object(Bucket="outputs", Key="p/o/j/b")
    assert head["ETag"].strip('"').endswith("-3")  # three parts
    url = store.url("o/j/b", expires_seconds=60, filename="b")
    import requests

    assert requests.get(url, timeout=10).content == data


def test_local_store_keys_cannot_escape(tmp_path: Path) -> None:
    from catacloud.storage import StoreError

    with pytest.raises(StoreError):
        LocalStore(tmp_path).put("../escape", io.BytesIO(b"x"), size=1)


# ---- uploads through the Agent API, reads through the user API -------------------------------------


def running_job(
    world: World, tmp_path: Path, retention_days: int = 7
) -> tuple[Job, APIClient, MachineInstance]:
    agent, instance = enrolled_agent(world.org, world.machine_type)
    config = job_config(
        world.org, world.machine_type, f"c{retention_days}", "x", artifact_retention_days=retention_days
    )
    MachineInstance.objects.filter(pk=instance.pk).update(status="claimed")
    job = job_row(config, status="running", instance=instance)
    MachineInstance.objects.filter(pk=instance.pk).update(claimed_for=f"job:{job.pk}")
    return job, agent, instance


def put(agent: APIClient, url: str, data: bytes, sha: str | None = None) -> Any:
    return agent.generic(
        "PUT",
        url,
        data,
        content_type="application/octet-stream",
        HTTP_X_CHECKSUM_SHA256=sha or hashlib.sha256(data).hexdigest(),
    )


@pytest.mark.django_db
def test_outputs_upload_checked_listed_and_downloaded(
    world: World, tmp_path: Path, local_storage: None
) -> None:
    job, agent, instance = running_job(world, tmp_path)
    data = os.urandom(300_000)
    base = f"/api/agent/v1/jobs/{job.pk}"
    bad = put(agent, f"{base}/artifacts/report.bin", data, sha="0" * 64)
    assert bad.status_code == 400 and bad.json()["code"] == "checksum_mismatch"
    assert not Artifact.objects.exists()  # nothing half-written
    ok = put(agent, f"{base}/artifacts/reports%2Fjunit.xml", data)  # a nested name, quoted
    assert ok.status_code == 201 and ok.json()["sha256"] == hashlib.sha256(data).hexdigest()
    evil = put(agent, f"{base}/artifacts/..%2F..%2Fetc%2Fpasswd", b"x")
    assert evil.status_code == 400

    viewer = world.client("viewer")
    listed = viewer.get(f"/api/v1/jobs/{job.pk}/artifacts/").json()
    assert [(a["name"], a["size"], a["sha256"]) for a in listed] == [
        ("reports/junit.xml", len(data), hashlib.sha256(data).hexdigest())
    ]
    response = viewer.get(f"/api/v1/jobs/{job.pk}/artifacts/reports/junit.xml")
    assert response.status_code == 200
    assert b"".join(response.streaming_content) == data
    # Another org's user: 404 for the list and the file alike.
    outsider = world.client("outsider")
    assert outsider.get(f"/api/v1/jobs/{job.pk}/artifacts/").status_code == 404
    assert outsider.get(f"/api/v1/jobs/{job.pk}/artifacts/reports/junit.xml").status_code == 404


@pytest.mark.django_db
def test_outputs_after_the_exit_report_then_the_machine_is_released(
    world: World, tmp_path: Path, local_storage: None
) -> None:
    job, agent, instance = running_job(world, tmp_path)
    base = f"/api/agent/v1/jobs/{job.pk}"
    finished = agent.post(
        f"{base}/finished", {"outcome": "failed", "exit_code": 2, "uploads_pending": 1}, format="json"
    )
    assert finished.status_code == 200
    assert finished.json() == {"ok": True, "status": "failed", "awaits_uploads": True}
    job.refresh_from_db()
    assert job.status == "failed"  # final at once: uploads never block the exit report
    instance.refresh_from_db()
    assert instance.status == "claimed"  # held until the uploads are done
    assert put(agent, f"{base}/artifacts/core.txt", b"after the end").status_code == 201
    done = agent.post(
        f"{base}/uploads-done", {"failed": [{"name": "huge.bin", "error": "too large"}]}, format="json"
    )
    assert done.status_code == 200
    instance.refresh_from_db()
    assert instance.status == "ready"  # released for reuse
    states = dict(Artifact.objects.filter(job=job).values_list("name", "status"))
    assert states == {"core.txt": "stored", "huge.bin": "failed"}
    assert put(agent, f"{base}/artifacts/late.txt", b"x").status_code == 409  # no more after that


@pytest.mark.django_db
@pytest.mark.parametrize(("reuse", "after"), [("reuse", "ready"), ("ephemeral", "terminating")])
def test_a_job_with_no_outputs_releases_its_machine_with_the_exit_report(
    world: World, tmp_path: Path, reuse: str, after: str
) -> None:
    # The exit report of a job without files releases the machine (kept for the next job, or
    # terminated), whatever the configuration's policy, and says the agent need not post
    # uploads-done.
    job, agent, instance = running_job(world, tmp_path)
    JobConfiguration.objects.filter(pk=job.config_id).update(reuse=reuse)
    base = f"/api/agent/v1/jobs/{job.pk}"
    finished = agent.post(
        f"{base}/finished", {"outcome": "succeeded", "exit_code": 0, "uploads_pending": 0}, format="json"
    )
    assert finished.status_code == 200
    assert finished.json() == {"ok": True, "status": "succeeded", "awaits_uploads": False}
    instance.refresh_from_db()
    assert instance.status == after
    # An older agent's uploads-done after it changes nothing.
    assert agent.post(f"{base}/uploads-done", {"failed": []}, format="json").status_code == 200
    instance.refresh_from_db()
    assert instance.status == after


@pytest.mark.django_db
def test_the_exit_report_carries_the_jobs_last_output_stored_before_its_end(
    world: World, tmp_path: Path
) -> None:
    job, agent, instance = running_job(world, tmp_path)
    base = f"/api/agent/v1/jobs/{job.pk}"
    first = {"chunks": [{"seq": 0, "stream": "stdout", "data": "one\x00\n"}]}  # binary output: NUL
    assert agent.post(f"{base}/logs", first, format="json").status_code == 200
    # Bad output refuses the whole report: nothing of it stored, the job still running.
    bad = {"outcome": "succeeded", "exit_code": 0, "output": [{"seq": -1, "stream": "stdout", "data": "x"}]}
    refused = agent.post(f"{base}/finished", bad, format="json")
    assert refused.status_code == 400 and refused.json()["code"] == "invalid"
    job.refresh_from_db()
    assert job.status == "running" and JobLogChunk.objects.filter(job=job).count() == 1
    last = [
        {"seq": 1, "stream": "stderr", "data": "two\n"},
        {"seq": 2, "stream": "stdout", "data": "3\x00\n"},
    ]
    for _ in range(2):  # a retried report stores nothing twice
        report = {"outcome": "succeeded", "exit_code": 0, "output": last}
        assert agent.post(f"{base}/finished", report, format="json").status_code == 200
    job.refresh_from_db()
    assert job.status == "succeeded"
    text = world.client("viewer").get(f"/api/v1/jobs/{job.pk}/logs/").json()["text"]
    assert text == "one\ufffd\ntwo\n3\ufffd\n"  # NUL kept as U+FFFD (PostgreSQL text holds none)


@pytest.mark.django_db
def test_a_checkpoint_is_saved_and_served_to_the_next_attempt(
    world: World, tmp_path: Path, local_storage: None
) -> None:
    job, agent, instance = running_job(world, tmp_path)
    blob = os.urandom(5000)
    assert put(agent, f"/api/agent/v1/jobs/{job.pk}/checkpoint", blob).status_code == 201
    work = agent.get("/api/agent/v1/work?wait=0")
    assert work.status_code == 204  # running, not assigned: nothing new
    got = agent.get(f"/api/agent/v1/jobs/{job.pk}/checkpoint")
    assert got.status_code == 200 and b"".join(got.streaming_content) == blob
    assert got["X-Checksum-Sha256"] == hashlib.sha256(blob).hexdigest()
    Job.objects.filter(pk=job.pk).update(status="assigned")
    payload = agent.get("/api/agent/v1/work?wait=0").json()["job"]
    assert payload["checkpoint"] == {"available": True, "interval_seconds": None}


@pytest.mark.django_db
def test_retention_deletes_expired_outputs(world: World, tmp_path: Path, local_storage: None) -> None:
    job, agent, instance = running_job(world, tmp_path, retention_days=1)
    assert put(agent, f"/api/agent/v1/jobs/{job.pk}/artifacts/old.txt", b"old").status_code == 201
    artifact = Artifact.objects.get()
    assert artifact.expires_at > timezone.now() + timedelta(hours=23)
    assert artifacts_expire(now=timezone.now() + timedelta(hours=12)) == 0
    assert artifacts_expire(now=timezone.now() + timedelta(days=2)) == 1
    artifact.refresh_from_db()
    assert artifact.status == "expired"
    assert get_store().size(artifact.key) is None
    assert world.client("viewer").get(f"/api/v1/jobs/{job.pk}/artifacts/old.txt").status_code == 404
    from apps.events.models import Event

    assert Event.objects.filter(kind="artifact.expired", job_id=job.pk).exists()
