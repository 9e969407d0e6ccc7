"""The webhook intake: the signature before anything, bad deliveries refused with nothing
written, a redelivery a no-op, workflow jobs moved forward only, labels matched to classes,
and one organization's deliveries never touching another's rows."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client, override_settings

from apps.github.models import WebhookDelivery, WorkflowJob
from apps.github.services import connection_set, match_class, runner_class_save
from apps.github.webhooks import signature_valid
from apps.jobs.models import Job
from testkit.github_fake import sign
from tests.github.conftest import INSTALLATION, LABELS, SECRET, GitHubWorld, deliver, workflow_job

pytestmark = pytest.mark.django_db


def test_githubs_documented_test_vector() -> None:
    """docs.github.com, "Validating webhook deliveries": this secret and payload give this header."""
    secret, payload = "It's a Secret to Everybody", b"Hello, World!"
    header = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
    assert sign(secret, payload) == header  # the fake signs as GitHub does
    assert signature_valid(secret, payload, header)
    assert not signature_valid(secret, b"Hello, World?", header)
    assert not signature_valid("It's a secret to everybody", payload, header)
    assert not signature_valid(secret, payload, header.upper())
    assert not signature_valid(secret, payload, header[:-1])
    assert not signature_valid(secret, payload, "sha1=" + header[7:])
    assert not signature_valid("", payload, header)


def _nothing_written() -> bool:
    return (
        not WebhookDelivery.objects.exists() and not WorkflowJob.objects.exists() and not Job.objects.exists()
    )


def _post(body: bytes, content_type: str = "application/json", **headers: str) -> Any:
    return Client().post("/api/integrations/github/webhook", body, content_type=content_type, **headers)


def test_bad_deliveries_get_a_4xx_with_a_code_and_write_nothing(gh: GitHubWorld) -> None:
    good = json.dumps(workflow_job(1, "queued")).encode()
    sig = sign(SECRET, good)
    base = {"HTTP_X_GITHUB_EVENT": "workflow_job", "HTTP_X_GITHUB_DELIVERY": "d-1"}
    cases = [
        ("unsigned", _post(good, **base), 401, "invalid_signature"),
        (
            "forged",
            _post(good, HTTP_X_HUB_SIGNATURE_256=sign("not-the-secret", good), **base),
            401,
            "invalid_signature",
        ),
        ("tampered", _post(good + b" ", HTTP_X_HUB_SIGNATURE_256=sig, **base), 401, "invalid_signature"),
        ("sha1 only", _post(good, HTTP_X_HUB_SIGNATURE="sha1=" + "0" * 40, **base), 401, "invalid_signature"),
        (
            "malformed signature",
            _post(good, HTTP_X_HUB_SIGNATURE_256="sha256=zz", **base),
            401,
            "invalid_signature",
        ),
        (
            "form-encoded",
            _post(good, "application/x-www-form-urlencoded", HTTP_X_HUB_SIGNATURE_256=sig, **base),
            415,
            "unsupported_media_type",
        ),
        (
            "no delivery id",
            _post(good, HTTP_X_HUB_SIGNATURE_256=sig, HTTP_X_GITHUB_EVENT="workflow_job"),
            400,
            "invalid",
        ),
        ("no event", _post(good, HTTP_X_HUB_SIGNATURE_256=sig, HTTP_X_GITHUB_DELIVERY="d-1"), 400, "invalid"),
        (
            "not JSON",
            _post(b"{not json", HTTP_X_HUB_SIGNATURE_256=sign(SECRET, b"{not json"), **base),
            400,
            "parse_error",
        ),
        (
            "not an object",
            _post(b"[1, 2]", HTTP_X_HUB_SIGNATURE_256=sign(SECRET, b"[1, 2]"), **base),
            400,
            "parse_error",
        ),
        ("GET", Client().get("/api/integrations/github/webhook"), 405, "method_not_allowed"),
    ]
    for what, response, status, code in cases:
        assert (response.status_code, response.json()["code"]) == (status, code), what
        assert response.json()["detail"], what
    with override_settings(CATACLOUD_GITHUB_WEBHOOK_MAX_BYTES=100):
        big = _post(good, HTTP_X_HUB_SIGNATURE_256=sig, **base)
    assert (big.status_code, big.json()["code"]) == (413, "payload_too_large")
    assert _nothing_written()


def test_a_delivery_for_an_installation_nobody_connected_is_202_and_ignored(gh: GitHubWorld) -> None:
    response = deliver("workflow_job", workflow_job(1, "queued", installation=999))
    assert response.status_code == 202 and response.json()["status"] == "ignored"
    assert _nothing_written()


def test_a_queued_job_of_a_class_becomes_a_catacloud_job_with_where_it_comes_from(gh: GitHubWorld) -> None:
    response = deliver("workflow_job", workflow_job(1, "queued"), guid="g-1")
    assert response.status_code == 200, response.content
    record = WorkflowJob.objects.get()
    assert (record.status, record.repository, record.runner_class) == ("queued", "acme/app", gh.runner_class)
    from apps.github.demand import class_converge

    class_converge(runner_class_id=gh.runner_class.pk)  # the task the delivery sent
    job = Job.objects.get()
    assert job.config == gh.runner_class.job_config and job.status == "queued"
    assert job.labels["repository"] == "acme/app" and job.labels["workflow"] == "CI"
    assert job.handoff_by == "github" and job.org == gh.world.org
    assert gh.installation.__class__.objects.get().account == "acme"


def test_a_redelivery_is_a_no_op(gh: GitHubWorld) -> None:
    first = deliver("workflow_job", workflow_job(1, "queued"), guid="same")
    again = deliver("workflow_job", workflow_job(1, "queued"), guid="same")
    assert first.status_code == 200 and again.status_code == 200 and again.json()["status"] == "duplicate"
    assert WebhookDelivery.objects.count() == 1 and WorkflowJob.objects.count() == 1


def test_status_moves_forward_only_whatever_the_order(gh: GitHubWorld) -> None:
    runner = "someone-elses-runner"
    deliver("workflow_job", workflow_job(1, "in_progress", runner_name=runner))
    deliver("workflow_job", workflow_job(1, "queued"))  # late: older than what we know
    assert WorkflowJob.objects.get().status == "in_progress"
    deliver("workflow_job", workflow_job(1, "completed", runner_name=runner, conclusion="success"))
    deliver("workflow_job", workflow_job(1, "in_progress", runner_name=runner))  # late again
    deliver("workflow_job", workflow_job(1, "queued"))
    record = WorkflowJob.objects.get()
    assert (record.status, record.conclusion, record.runner_name) == ("completed", "success", runner)
    # waiting and queued share a rank: an approved job (waiting -> queued) moves
    deliver("workflow_job", workflow_job(2, "waiting"))
    deliver("workflow_job", workflow_job(2, "queued"))
    assert WorkflowJob.objects.get(github_id=2).status == "queued"
    # a re-run is another record: (job id, run attempt)
    deliver("workflow_job", workflow_job(1, "queued", run_attempt=2))
    assert WorkflowJob.objects.filter(github_id=1).count() == 2


def test_jobs_for_other_runners_are_ignored(gh: GitHubWorld) -> None:
    for labels in (
        ["ubuntu-latest"],
        ["self-hosted"],
        ["self-hosted", "linux"],
        ["self-hosted", "gpu-box"],
        [],
    ):
        assert deliver("workflow_job", workflow_job(1, "queued", labels=labels)).status_code == 200
    assert not WorkflowJob.objects.exists() and not Job.objects.exists()


def test_label_matching_picks_the_most_specific_class(gh: GitHubWorld) -> None:
    big, _ = runner_class_save(
        org=gh.world.org,
        name="big",
        labels=["self-hosted", "linux", "catacloud-linux-2cpu", "catacloud-big"],
        machine_type=gh.world.machine_type,
    )
    classes = [gh.runner_class, big]
    assert match_class(classes, ["self-hosted", "catacloud-linux-2cpu"]) == gh.runner_class
    assert (
        match_class(classes, ["Self-Hosted", "CATACLOUD-LINUX-2CPU"]) == gh.runner_class
    )  # case-insensitive
    assert match_class(classes, ["catacloud-big"]) == big
    assert match_class(classes, ["linux", "catacloud-linux-2cpu"]) == big  # only big has linux
    assert match_class(classes, ["self-hosted", "catacloud-big", "gpu"]) is None  # gpu: nobody has it
    assert match_class(classes, ["self-hosted", "linux"]) is None  # generic labels only


def test_one_orgs_secret_cannot_feed_another_orgs_installation(gh: GitHubWorld, app_key: Any) -> None:
    """Rival connects its own App; a delivery signed with rival's secret naming acme's
    installation is ignored: the installation must belong to a connection whose secret signed it."""
    rival = gh.world.other_org
    connection_set(
        org=rival,
        app_id=7,
        api_url=gh.fake.url,
        private_key=app_key[0],
        webhook_secret="rival-secret-123",
        installations=[43],
    )
    response = deliver(
        "workflow_job", workflow_job(1, "queued", installation=INSTALLATION), secret="rival-secret-123"
    )
    assert response.status_code == 202 and response.json()["status"] == "ignored"
    assert not WorkflowJob.objects.exists()
    # rival's own installation is rival's: its rows carry rival, never acme
    runner_class_save(org=rival, name="r", labels=LABELS, machine_type=gh.world.machine_type)
    ok = deliver("workflow_job", workflow_job(5, "queued", installation=43), secret="rival-secret-123")
    assert ok.status_code == 200
    assert list(WorkflowJob.objects.values_list("org__slug", flat=True)) == ["rival"]
    assert WebhookDelivery.objects.get().org == rival


def test_the_ping_is_answered(gh: GitHubWorld) -> None:
    response = deliver("ping", {"zen": "Keep it logically awesome.", "hook_id": 1})
    assert response.status_code == 200 and response.json()["status"] == "pong"
    assert _nothing_written()


@pytest.mark.django_db(transaction=True)
def test_a_delivery_is_acted_on_while_another_transaction_holds_its_installation(gh: GitHubWorld) -> None:
    """A second delivery of the same installation, or a reconcile's claim, holds the installation
    row: a delivery arriving meanwhile is acted on at once (or right after), never skipped as if
    it were being processed elsewhere and left for the reaper's rule seconds later."""
    import threading

    from tests.concurrency import holder_connection

    holder = holder_connection()
    table = gh.installation.__class__._meta.db_table
    holder.execute(f"UPDATE {table} SET next_poll_at = next_poll_at WHERE id = %s", [gh.installation.pk])
    release = threading.Timer(1.0, holder.commit)
    release.start()
    try:
        response = deliver("workflow_job", workflow_job(7, "queued"), guid="while-held")
    finally:
        release.join()
        holder.close()
    assert response.status_code == 200, response.content
    delivery = WebhookDelivery.objects.get(guid="while-held")
    assert delivery.processed_at is not None, "skipped: left for the reaper"
    assert WorkflowJob.objects.get().github_id == 7
