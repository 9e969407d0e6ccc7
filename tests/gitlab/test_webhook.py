"""The Job event intake: the secret token before anything, bad deliveries refused with nothing
written, the same event twice a no-op, jobs moved forward only, tags matched to classes (read
from the jobs API where the event lacks them, after the answer), and one organization's events
never touching another's rows."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client, override_settings

from apps.ci.demand import class_converge
from apps.gitlab.forge import GITLAB
from apps.gitlab.intake import delivery_resolve
from apps.gitlab.models import GitLabDelivery, GitLabJob
from apps.gitlab.services import connection_set, runner_class_save
from apps.gitlab.webhooks import token_valid
from apps.jobs.models import Job
from tests.gitlab.conftest import APP, SECRET, TAGS, GitLabWorld, deliver, job_event

pytestmark = pytest.mark.django_db


def _nothing_written() -> bool:
    return not GitLabDelivery.objects.exists() and not GitLabJob.objects.exists() and not Job.objects.exists()


def _post(body: bytes, content_type: str = "application/json", **headers: str) -> Any:
    return Client().post("/api/integrations/gitlab/webhook", body, content_type=content_type, **headers)


def test_the_secret_token_is_compared_whole() -> None:
    assert token_valid(SECRET, SECRET)
    for given in (SECRET[:-1], SECRET + "x", SECRET.upper(), "", " " + SECRET):
        assert not token_valid(SECRET, given), given
    assert not token_valid("", "")  # a connection without a token never matches


def test_bad_deliveries_get_a_4xx_with_a_code_and_write_nothing(gl: GitLabWorld) -> None:
    good = json.dumps(job_event(1, "pending", tags=TAGS)).encode()
    base = {"HTTP_X_GITLAB_EVENT": "Job Hook", "HTTP_IDEMPOTENCY_KEY": "k-1"}
    auth = {"HTTP_X_GITLAB_TOKEN": SECRET}
    cases = [
        ("no token", _post(good, **base), 401, "invalid_signature"),
        ("wrong token", _post(good, HTTP_X_GITLAB_TOKEN="not-the-secret", **base), 401, "invalid_signature"),
        ("almost the token", _post(good, HTTP_X_GITLAB_TOKEN=SECRET[:-1], **base), 401, "invalid_signature"),
        (
            "form-encoded",
            _post(good, "application/x-www-form-urlencoded", **auth, **base),
            415,
            "unsupported_media_type",
        ),
        ("no idempotency key", _post(good, HTTP_X_GITLAB_EVENT="Job Hook", **auth), 400, "invalid"),
        (
            "a bad key",
            _post(good, **auth, HTTP_X_GITLAB_EVENT="Job Hook", HTTP_IDEMPOTENCY_KEY="a b"),
            400,
            "invalid",
        ),
        ("no event", _post(good, **auth, HTTP_IDEMPOTENCY_KEY="k-1"), 400, "invalid"),
        ("not JSON", _post(b"{not json", **auth, **base), 400, "parse_error"),
        ("not an object", _post(b"[1, 2]", **auth, **base), 400, "parse_error"),
        ("GET", Client().get("/api/integrations/gitlab/webhook"), 405, "method_not_allowed"),
    ]
    for what, response, status, code in cases:
        assert (response.status_code, response.json()["code"]) == (status, code), what
        assert response.json()["detail"], what
    with override_settings(CATACLOUD_GITLAB_WEBHOOK_MAX_BYTES=100):
        big = _post(good, **auth, **base)
    assert (big.status_code, big.json()["code"]) == (413, "payload_too_large")
    assert _nothing_written()


def test_events_for_projects_nobody_connected_and_other_events_are_202_and_ignored(gl: GitLabWorld) -> None:
    other = deliver(job_event(1, "pending", tags=TAGS, project_id=999))
    assert other.status_code == 202 and other.json()["status"] == "ignored"
    pipeline = deliver({"object_kind": "pipeline", "object_attributes": {"id": 5}}, event="Pipeline Hook")
    assert pipeline.status_code == 202 and pipeline.json()["status"] == "ignored"
    assert _nothing_written()


def test_a_pending_job_with_its_tags_becomes_a_catacloud_job(gl: GitLabWorld) -> None:
    response = deliver(job_event(1, "pending", tags=TAGS, pipeline="Nightly"), key="k-1")
    assert response.status_code == 200 and response.json()["status"] == "created", response.content
    record = GitLabJob.objects.get()
    assert (record.status, record.project, record.pipeline, record.runner_class) == (
        "pending",
        "acme/app",
        "Nightly",
        gl.runner_class,
    )
    class_converge(forge=GITLAB, runner_class_id=gl.runner_class.pk)  # the task the event sent
    job = Job.objects.get()
    assert job.config == gl.runner_class.job_config and job.status == "queued"
    assert job.labels["repository"] == "acme/app" and job.labels["workflow"] == "Nightly"
    assert job.labels["forge"] == "gitlab" and job.labels["gitlab_job_id"] == 1
    assert job.handoff_by == "gitlab" and job.env["CI_SERVER_URL"] == gl.fake.url
    assert gl.fake.api_calls() == 0


def test_tags_are_read_from_the_jobs_api_after_the_answer(gl: GitLabWorld) -> None:
    """GitLab's Job events do not carry the job's tags: the event is stored and answered first,
    then the job is looked up (one call) and acted on."""
    gitlab_id = gl.fake.queue_job("acme/app", TAGS, ["true"], pipeline="CI")
    response = deliver(job_event(gitlab_id, "pending"), key="k-1")
    assert response.status_code == 200 and response.json()["status"] == "deferred"
    assert gl.fake.api_calls() == 0 and not GitLabJob.objects.exists()  # answered before any call
    assert delivery_resolve(key="k-1") == "created"  # the task the answer sent
    assert gl.fake.count("GET", "/projects/{id}/jobs/{id}") == 1
    record = GitLabJob.objects.get()
    assert (record.gitlab_id, record.tags, record.status) == (gitlab_id, sorted(TAGS), "pending")
    assert GitLabDelivery.objects.get().outcome == "created"
    # the job's next events need no look-up: its class is known
    deliver(job_event(gitlab_id, "running", runner={"id": 5, "description": "someone-elses"}))
    assert gl.fake.api_calls() == 1 and GitLabJob.objects.get().status == "running"


def test_a_new_job_costs_one_look_up_whatever_its_events(gl: GitLabWorld) -> None:
    """GitLab sends a job's ``created`` and ``pending`` events moments apart: the ``created`` one
    of a job new to us is not demand and costs no call; two ``pending`` ones resolved at once (a
    second delivery, or one resolved after another) cost one look-up between them."""
    gitlab_id = gl.fake.queue_job("acme/app", TAGS, ["true"], pipeline="CI")
    created = deliver(job_event(gitlab_id, "created"), key="k-created")
    assert created.json()["status"] == "ignored: created, acted on once pending"
    assert not GitLabJob.objects.exists()
    for key in ("k-pending", "k-pending-again"):
        assert deliver(job_event(gitlab_id, "pending"), key=key).json()["status"] == "deferred"
    assert delivery_resolve(key="k-pending") == "created"
    assert delivery_resolve(key="k-pending-again") != "created"  # known by now: no second look-up
    assert gl.fake.count("GET", "/projects/{id}/jobs/{id}") == 1
    assert GitLabJob.objects.get().status == "pending"


def test_an_event_seen_twice_is_a_no_op(gl: GitLabWorld) -> None:
    first = deliver(job_event(1, "pending", tags=TAGS), key="same")
    again = deliver(job_event(1, "pending", tags=TAGS), key="same")
    assert first.status_code == 200 and again.status_code == 200 and again.json()["status"] == "duplicate"
    # older GitLab: no Idempotency-Key, X-Gitlab-Event-UUID only
    from django.test import Client

    body = json.dumps(job_event(2, "pending", tags=TAGS)).encode()
    headers = {
        "HTTP_X_GITLAB_EVENT": "Job Hook",
        "HTTP_X_GITLAB_TOKEN": SECRET,
        "HTTP_X_GITLAB_EVENT_UUID": "u-1",
    }
    for expected in ("deferred", "duplicate"):  # its tags are looked up after the answer
        answer = Client().post(
            "/api/integrations/gitlab/webhook", body, content_type="application/json", **headers
        )
        assert answer.json()["status"] == expected
    # the second job waits for its tags' look-up (stored, not acted on yet)
    assert GitLabDelivery.objects.count() == 2 and GitLabJob.objects.count() == 1


def test_status_moves_forward_only_whatever_the_order(gl: GitLabWorld) -> None:
    theirs = {"id": 77, "description": "someone-elses-runner"}
    deliver(job_event(1, "running", tags=TAGS, runner=theirs))
    deliver(job_event(1, "pending", tags=TAGS))  # late: older than what we know
    assert GitLabJob.objects.get().status == "running"
    deliver(job_event(1, "failed", tags=TAGS, runner=theirs, failure_reason="script_failure"))
    deliver(job_event(1, "running", tags=TAGS, runner=theirs))  # late again
    deliver(job_event(1, "pending", tags=TAGS))
    record = GitLabJob.objects.get()
    assert (record.status, record.conclusion, record.failure_reason, record.runner_name) == (
        "failed",
        "failed",
        "script_failure",
        "someone-elses-runner",
    )
    # the statuses before a runner takes a job share a rank: created -> pending moves
    deliver(job_event(2, "created", tags=TAGS))
    deliver(job_event(2, "pending", tags=TAGS))
    assert GitLabJob.objects.get(gitlab_id=2).status == "pending"
    # a retry is another job (another id)
    deliver(job_event(3, "pending", tags=TAGS))
    assert GitLabJob.objects.count() == 3


def test_jobs_for_other_runners_are_ignored(gl: GitLabWorld) -> None:
    for tags in ([], ["docker"], ["catacloud", "gpu"], ["linux-2cpu", "windows"]):
        assert deliver(job_event(1, "pending", tags=tags)).status_code == 200
    assert not GitLabJob.objects.exists() and not Job.objects.exists()


def test_tags_pick_the_most_specific_class(gl: GitLabWorld) -> None:
    big, _ = runner_class_save(
        org=gl.world.org,
        name="big",
        tags=["catacloud", "linux-2cpu", "big"],
        machine_type=gl.world.machine_type,
    )
    deliver(job_event(1, "pending", tags=["CATACLOUD", "linux-2cpu"]))  # case-insensitive
    deliver(job_event(2, "pending", tags=["big"]))
    deliver(job_event(3, "pending", tags=["catacloud"]))
    classes = dict(GitLabJob.objects.values_list("gitlab_id", "runner_class__name"))
    assert classes == {1: "small", 2: "big", 3: "small"}
    assert big.job_config.name == "gitlab-big"


def test_one_orgs_token_cannot_feed_another_orgs_project(gl: GitLabWorld) -> None:
    rival = gl.world.other_org
    connection_set(
        org=rival,
        url=gl.fake.url,
        token="glpat-rival",
        webhook_token="rival-secret-123",
        projects=[{"id": 99, "path": "rival/app"}],
    )
    response = deliver(job_event(1, "pending", tags=TAGS, project_id=APP), token="rival-secret-123")
    assert response.status_code == 202 and response.json()["status"] == "ignored"
    assert not GitLabJob.objects.exists()
    runner_class_save(org=rival, name="r", tags=TAGS, machine_type=gl.world.machine_type)
    ok = deliver(job_event(5, "pending", tags=TAGS, project_id=99), token="rival-secret-123")
    assert ok.status_code == 200
    assert list(GitLabJob.objects.values_list("org__slug", flat=True)) == ["rival"]
    assert GitLabDelivery.objects.get().org == rival
