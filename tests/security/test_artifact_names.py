"""Boundary: an agent's uploads land only under its own job's ``<org>/<job>/`` folder.

Shown on main: a double-encoded name (``a%252F..%252F…``) was decoded after the check and
wrote into another org's job outputs (or over its checkpoint).
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from apps.jobs.artifacts import clean_name
from apps.jobs.models import Artifact, Job
from catacloud.storage import LocalStore, StoreError
from tests.conftest import World
from tests.jobs.test_artifacts import put, running_job

pytestmark = pytest.mark.django_db


def victim_job(world: World, tmp_path: Path) -> Job:
    """A job of the other org that already stored an output."""
    victim, victim_agent, _ = running_job(world, tmp_path, retention_days=3)
    Job.objects.filter(pk=victim.pk).update(org=world.other_org)
    victim.refresh_from_db()
    assert put(victim_agent, f"/api/agent/v1/jobs/{victim.pk}/artifacts/x", b"victim").status_code == 201
    return victim


@pytest.mark.parametrize(
    "name",
    [
        "a%252F..%252F..%252F..%252F..%252F{org}%252F{job}%252Foutputs%252Fx",  # double-encoded
        "a%25252F..%25252F..%25252F..%25252F..%25252F{org}%25252F{job}%25252Foutputs%25252Fx",
        "..%252F..%252F..%252F{org}%252F{job}%252Fcheckpoint.tar.gz",
        "a%255C..%255C..%255Cx",  # backslashes, double-encoded
        "..%2F..%2F{org}%2F{job}%2Foutputs%2Fx",  # single-encoded
        "..",
        "a/./b",
        "a%00b",
    ],
)
def test_an_agent_cannot_write_into_another_orgs_job(
    world: World,
    tmp_path: Path,
    local_storage: None,
    name: str,
) -> None:
    victim = victim_job(world, tmp_path)
    job, agent, _ = running_job(world, tmp_path)
    url_name = name.format(org=victim.org_id, job=victim.pk)

    response = put(agent, f"/api/agent/v1/jobs/{job.pk}/artifacts/{url_name}", b"evil")

    # Refused, or kept as a literal (never decoded twice) name inside its own job's folder.
    assert response.status_code in (201, 400), response.content
    if response.status_code == 400:
        assert response.json()["code"] == "invalid"
        assert not Artifact.objects.filter(job=job).exists()  # nothing recorded for a refused name
    else:
        assert "/" not in response.json()["name"]  # one literal part, "%2F" and all
    root = tmp_path / "artifacts"
    for artifact in Artifact.objects.filter(job=job):
        assert artifact.key.startswith(f"{job.org_id}/{job.pk}/outputs/")
        assert (root / artifact.key).resolve().parent == (root / str(job.org_id) / str(job.pk) / "outputs")
    stored = root / str(victim.org_id) / str(victim.pk) / "outputs" / "x"
    assert stored.read_bytes() == b"victim"  # the other org's output is untouched
    assert not (stored.parent.parent / "checkpoint.tar.gz").exists()
    assert sorted(p.name for p in stored.parent.iterdir()) == ["x"]


def test_a_name_with_a_percent_sign_is_kept_as_is(world: World, tmp_path: Path, local_storage: None) -> None:
    job, agent, _ = running_job(world, tmp_path)
    response = put(agent, f"/api/agent/v1/jobs/{job.pk}/artifacts/100%25.txt", b"x")
    assert response.status_code == 201 and response.json()["name"] == "100%.txt"
    stored = tmp_path / "artifacts" / str(job.org_id) / str(job.pk) / "outputs" / "100%.txt"
    assert stored.read_bytes() == b"x"


def test_a_one_character_name_lists_and_downloads(world: World, tmp_path: Path, local_storage: None) -> None:
    job, agent, _ = running_job(world, tmp_path)
    assert put(agent, f"/api/agent/v1/jobs/{job.pk}/artifacts/x", b"one").status_code == 201
    viewer = world.client("viewer")
    assert [a["name"] for a in viewer.get(f"/api/v1/jobs/{job.pk}/artifacts/").json()] == ["x"]
    response = viewer.get(f"/api/v1/jobs/{job.pk}/artifacts/x")
    assert response.status_code == 200
    assert b"".join(response.streaming_content) == b"one"


def test_names_are_validated_segment_by_segment() -> None:
    assert clean_name("reports/junit.xml") == "reports/junit.xml"
    for bad in ("a/../b", "../x", "a//b", "/abs", "a\\b", "a\x00b", "a\nb", "x" * 256, "a/" * 500 + "b"):
        assert clean_name(bad) is None, bad


def test_every_store_refuses_keys_outside_org_job(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    for key in ("org/job/../../other/job/outputs/x", "org/../other/job/x", "org/job", "org/job/a\x00b"):
        with pytest.raises(StoreError):
            store.put(key, io.BytesIO(b"x"), size=1)
    # A symlink planted inside the store does not lead a write out of its org/job folder.
    (tmp_path / "store" / "org" / "job").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "store" / "org" / "job" / "outputs").symlink_to(tmp_path / "outside")
    with pytest.raises(StoreError):
        store.put("org/job/outputs/x", io.BytesIO(b"x"), size=1)
    assert not (tmp_path / "outside" / "x").exists()


def test_s3_keys_follow_the_same_rule(moto_s3: object) -> None:
    from catacloud.storage import S3Store

    store = S3Store(bucket="outputs", prefix="p", client=moto_s3)
    with pytest.raises(StoreError):
        store.put("org/job/../../other/job/outputs/x", io.BytesIO(b"x"), size=1)
