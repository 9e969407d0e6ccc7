"""What the one GitLab client answers: typed values read from GitLab's JSON in one place each,
with the defaults the callers had when they picked fields out of dicts (no database, no
GitLab: each type's ``from_api`` on the JSON GitLab sends)."""

from __future__ import annotations

from datetime import UTC, datetime

from apps.ci.choices import Applied
from apps.gitlab.client import CreatedRunner, JobInfo, RunnerInfo
from apps.gitlab.ops import api_report


def test_a_job_of_the_jobs_api_is_read_field_by_field() -> None:
    job = JobInfo.from_api(
        {
            "id": 11,
            "status": "failed",
            "tag_list": ["Linux", "CC"],
            "ref": "main",
            "name": "test",
            "stage": "check",
            "pipeline": {"id": 5, "name": None},
            "runner": {"id": 3, "description": "cc-1"},
            "started_at": "2024-05-01T10:00:00Z",
            "finished_at": None,
            "failure_reason": "script_failure",
        }
    )
    assert (job.id, job.status, job.tags, job.ref, job.name, job.stage) == (
        11,
        "failed",
        ("linux", "cc"),
        "main",
        "test",
        "check",
    )
    assert (job.pipeline_id, job.pipeline, job.runner_id, job.runner_name) == (5, "main", 3, "cc-1")
    assert job.started_at == datetime(2024, 5, 1, 10, tzinfo=UTC) and job.finished_at is None
    report = api_report(job, 9, "acme/app")
    assert not isinstance(report, Applied)
    assert report.key == {"gitlab_id": 11} and report.update == {"failure_reason": "script_failure"}


def test_a_sparse_job_gets_the_defaults_and_no_key_without_an_id() -> None:
    job = JobInfo.from_api({"status": "pending", "tag_list": ["ok", 3], "pipeline": "x", "runner": None})
    assert (job.id, job.tags, job.pipeline_id, job.runner_id, job.started_at) == (None, (), None, None, None)
    assert api_report(job, 9, "acme/app") == Applied.NOT_A_JOB
    assert api_report(JobInfo.from_api({"id": 1, "status": "odd"}), 9, "a/b") == Applied.UNKNOWN_STATUS


def test_runners_and_the_created_runners_secret() -> None:
    assert RunnerInfo.from_api({"id": "4", "description": None, "status": "online"}) == RunnerInfo(
        4, "", online=True
    )
    created = CreatedRunner.from_api({"id": 8, "token": "glrt-SECRET", "token_expires_at": None})
    assert (created.id, created.token) == (8, "glrt-SECRET") and "SECRET" not in repr(created)
