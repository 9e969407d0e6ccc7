"""What the one GitHub client answers: typed values read from GitHub's JSON in one place each,
with the defaults the callers had when they picked fields out of dicts (no database, no
GitHub: each type's ``from_api`` on the JSON GitHub sends)."""

from __future__ import annotations

from datetime import UTC, datetime

from apps.ci.choices import Applied
from apps.github.client import (
    HookDelivery,
    InstallationToken,
    JitRunner,
    Repository,
    RunnerInfo,
    WorkflowJobInfo,
    WorkflowRun,
)
from apps.github.ops import workflow_job_report


def test_a_full_workflow_job_is_read_field_by_field() -> None:
    job = WorkflowJobInfo.from_api(
        {
            "id": 7,
            "run_id": "70",
            "run_attempt": 2,
            "status": "in_progress",
            "workflow_name": "ci",
            "name": "build",
            "labels": ["self-hosted", "linux"],
            "runner_name": "cc-1",
            "runner_id": 5,
            "started_at": "2024-05-01T10:00:00Z",
            "completed_at": None,
            "conclusion": None,
        }
    )
    assert (job.id, job.run_id, job.run_attempt, job.status) == (7, 70, 2, "in_progress")
    assert (job.workflow_name, job.name, job.labels) == ("ci", "build", ("self-hosted", "linux"))
    assert (job.runner_name, job.runner_id, job.conclusion) == ("cc-1", 5, "")
    assert job.started_at == datetime(2024, 5, 1, 10, tzinfo=UTC) and job.completed_at is None


def test_a_sparse_workflow_job_gets_the_defaults_and_no_key_when_it_has_no_ids() -> None:
    job = WorkflowJobInfo.from_api({"status": "queued", "runner_id": "5", "workflow_name": None})
    assert (job.id, job.run_id, job.run_attempt, job.runner_id) == (None, None, 1, None)
    assert (job.workflow_name, job.labels, job.started_at) == ("", (), None)  # null: said, empty
    assert WorkflowJobInfo.from_api({}).workflow_name is None  # absent: the poll takes its run's
    assert WorkflowJobInfo.from_api({"run_attempt": "two"}).run_attempt is None
    assert workflow_job_report(job, None, "acme/app") == Applied.NOT_A_WORKFLOW_JOB
    assert workflow_job_report(WorkflowJobInfo.from_api({"id": 1}), None, "a/b") == Applied.UNKNOWN_STATUS


def test_a_polled_job_reports_as_a_delivered_one() -> None:
    job = WorkflowJobInfo.from_api({"id": 3, "run_id": 30, "status": "requested", "labels": ["x"]})
    report = workflow_job_report(job, None, "acme/app")
    assert not isinstance(report, Applied)
    assert report.key == {"github_id": 3, "run_attempt": 1} and report.status == "queued"
    assert report.create == {
        "run_id": 30,
        "repository": "acme/app",
        "workflow": "",
        "name": "",
        "labels": ["x"],
        "public": False,
    }


def test_runners_runs_repositories_and_deliveries() -> None:
    assert RunnerInfo.from_api({"id": 4, "name": "r", "status": "online", "busy": True}) == RunnerInfo(
        4, "r", online=True, busy=True
    )
    assert RunnerInfo.from_api({"id": "4"}) == RunnerInfo(4, "", online=False, busy=False)
    assert WorkflowRun.from_api({"id": 9, "name": None}) == WorkflowRun(9, "")
    assert Repository.from_api({}).full_name == ""
    delivery = HookDelivery.from_api({"id": 1, "guid": "g", "status_code": None})
    assert (delivery.status_code, delivery.ok, delivery.event) == (0, False, None)
    assert HookDelivery.from_api({"id": 2, "status_code": 202}).ok


def test_the_secrets_are_never_in_a_repr() -> None:
    jit = JitRunner.from_api({"runner": {"id": 1, "name": "n"}, "encoded_jit_config": "SECRET-JIT"})
    token = InstallationToken.from_api({"token": "ghs_SECRET", "expires_at": "2024-05-01T11:00:00Z"})
    assert token.expires_at == datetime(2024, 5, 1, 11, tzinfo=UTC) and token.token == "ghs_SECRET"
    assert "SECRET" not in repr(jit) and "SECRET" not in repr(token)
