"""Errors that say what to do (issue 28): every message below names the fix, not only the fault."""

from __future__ import annotations

import json

import pytest

from apps.jobs.models import Job, JobConfiguration
from apps.jobs.reports import job_finished, job_started
from apps.jobs.submission import job_cancel, job_submit
from apps.machines.models import Budget, MachineType
from apps.pools.models import InstancePool
from testkit.builders import granted_type, idle_machine, job_config, job_row
from tests.conftest import World

pytestmark = pytest.mark.django_db


def _large(world: World) -> MachineType:
    """A machine type that exists, granted to the other organization only."""
    return granted_type(world.other_org, world.account, "large", cpus=8)[0]


# ---- machine_type: a name or an id, everywhere --------------------------------------------------


def test_job_configurations_pools_and_budgets_take_a_machine_type_by_name_or_id(world: World) -> None:
    admin = world.client("admin")
    mt = world.machine_type
    for ref, name in ((mt.name, "by-name"), (str(mt.pk), "by-id")):
        config = admin.post(
            "/api/v1/job-configs/", {"name": name, "machine_type": ref, "command": "true"}, format="json"
        )
        assert config.status_code == 201, config.json()
        assert config.json()["machine_type"] == str(mt.pk) and config.json()["machine_type_name"] == "small"
        pool = admin.post(
            "/api/v1/pools/", {"name": name, "machine_type": ref, "target_size": 0}, format="json"
        )
        assert pool.status_code == 201, pool.json()
        assert pool.json()["machine_type_name"] == "small"
        budget = admin.post(
            "/api/v1/budgets/", {"amount": "5", "period": "day", "machine_type": ref}, format="json"
        )
        assert budget.status_code == 201, budget.json()
        assert budget.json()["machine_type"] == "small"
    assert JobConfiguration.objects.filter(machine_type=mt).count() == 2
    assert InstancePool.objects.filter(machine_type=mt).count() == 2
    assert Budget.objects.filter(machine_type=mt).count() == 1  # upserted


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/v1/job-configs/", {"name": "big", "command": "true"}),
        ("/api/v1/pools/", {"name": "big", "target_size": 1}),
        ("/api/v1/budgets/", {"amount": "5", "period": "day"}),
    ],
)
def test_a_machine_type_without_a_grant_names_the_grant_and_the_organization(
    world: World, path: str, body: dict
) -> None:
    large = _large(world)
    admin = world.client("admin")
    for ref in ("large", str(large.pk)):
        answer = admin.post(path, {**body, "machine_type": ref}, format="json")
        assert answer.status_code == 400, answer.json()
        message = f"no grant for {ref} in organization acme (it may use: small)"
        assert answer.json()["detail"] == f"machine_type: {message}"
        assert answer.json()["fields"] == {"machine_type": [message]}
    # the same answer for a type that exists nowhere: no tenant learns what others may use
    unknown = admin.post(path, {**body, "machine_type": "nope"}, format="json")
    assert unknown.status_code == 400
    assert (
        unknown.json()["detail"] == "machine_type: no grant for nope in organization acme (it may use: small)"
    )
    assert not JobConfiguration.objects.exists() and not InstancePool.objects.exists()
    assert not Budget.objects.exists()


def test_a_submit_whose_grant_was_withdrawn_names_it(world: World) -> None:
    config = job_config(world.org, world.machine_type, "nightly")
    world.grant.delete()
    answer = world.client("member").post("/api/v1/jobs/", {"config": "nightly"}, format="json")
    assert answer.status_code == 409 and answer.json()["code"] == "machine_type_not_granted"
    assert answer.json()["detail"].startswith("no grant for small in organization acme")
    assert not Job.objects.filter(config=config).exists()


# ---- unknown and read-only fields -----------------------------------------------------------------


def test_a_submit_naming_a_machine_type_is_refused_not_run_elsewhere(world: World) -> None:
    job_config(world.org, world.machine_type, "unit-tests")
    answer = world.client("member").post(
        "/api/v1/jobs/", {"config": "unit-tests", "machine_type": "large"}, format="json"
    )
    assert answer.status_code == 400 and answer.json()["code"] == "invalid"
    detail = answer.json()["detail"]
    assert detail.startswith("machine_type: unknown field (a job runs on its configuration's machine type")
    assert "POST /job-configs/" in detail
    assert not Job.objects.exists()


def test_unknown_and_read_only_fields_are_named(world: World) -> None:
    admin = world.client("admin")
    body = {"name": "ci", "machine_type": "small", "target_size": 0}
    typo = admin.post("/api/v1/pools/", {**body, "target_sise": 3}, format="json")
    assert typo.status_code == 400
    assert typo.json()["detail"].startswith("target_sise: unknown field (this endpoint takes ")
    assert "target_size" in typo.json()["detail"]
    read_only = admin.post("/api/v1/pools/", {**body, "status": "ready", "id": "x"}, format="json")
    assert read_only.status_code == 400
    assert read_only.json()["fields"] == {
        "status": ["read-only: Catacloud sets it; leave it out"],
        "id": ["read-only: Catacloud sets it; leave it out"],
    }
    assert not InstancePool.objects.exists()
    pool = admin.post("/api/v1/pools/", body, format="json").json()
    patch = admin.patch(f"/api/v1/pools/{pool['id']}/", {"machine_type": "small"}, format="json")
    assert patch.status_code == 400 and patch.json()["detail"].startswith("machine_type: unknown field")
    acquire = world.client("member").post(
        f"/api/v1/pools/{pool['id']}/acquire/", {"aquired_by": "runner-7"}, format="json"
    )
    assert acquire.status_code == 400 and "aquired_by: unknown field" in acquire.json()["detail"]


# ---- a body that was not read as JSON ---------------------------------------------------------------


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", ""])
def test_a_json_body_without_its_content_type_says_so(world: World, content_type: str) -> None:
    """curl -d '{…}' sends application/x-www-form-urlencoded; a bare body sends none."""
    job_config(world.org, world.machine_type, "unit-tests")
    answer = world.client("member").generic(
        "POST", "/api/v1/jobs/", json.dumps({"config": "unit-tests"}), content_type=content_type
    )
    assert answer.status_code == 415 and answer.json()["code"] == "unsupported_media_type"
    detail = answer.json()["detail"]
    assert detail.startswith("the body was not read as JSON: its Content-Type is ")
    assert (content_type or "missing") in detail
    assert "Content-Type: application/json" in detail
    assert not Job.objects.exists()


# ---- the Authorization scheme -------------------------------------------------------------------------


@pytest.mark.parametrize(("header", "got"), [("Token {t}", "the scheme 'Token'"), ("{t}", "no scheme")])
def test_a_valid_token_under_another_scheme_says_the_scheme_is_bearer(
    world: World, header: str, got: str
) -> None:
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=header.format(t=world.tokens["viewer"]))
    answer = client.get("/api/v1/jobs/")
    assert answer.status_code == 401 and answer.json()["code"] == "authentication_failed"
    assert answer.json()["detail"] == (
        f"the Authorization scheme is Bearer: send 'Authorization: Bearer <token>' (got {got})"
    )
    assert world.tokens["viewer"] not in answer.content.decode()


# ---- reasons say who did what -------------------------------------------------------------------------


def test_a_cancel_names_the_user_who_asked_and_a_success_has_no_reason(world: World) -> None:
    config = job_config(world.org, world.machine_type, "long", reuse="reuse")
    member = world.client("member")

    queued = job_submit(org=world.org, config=config)
    assert member.post(f"/api/v1/jobs/{queued.pk}/cancel/").status_code == 202
    body = member.get(f"/api/v1/jobs/{queued.pk}/").json()
    assert (
        body["status"] == "cancelled" and body["failure_reason"] == "cancelled by user:member before it ran"
    )

    machine = idle_machine(world.org, world.machine_type, status="claimed")
    running = job_row(config, status="assigned", instance=machine, attempt=1)
    job_started(instance=machine, job_id=running.pk)
    assert member.post(f"/api/v1/jobs/{running.pk}/cancel/").status_code == 202
    # the agent only knows the control plane told it to stop
    job_finished(
        instance=machine, job_id=running.pk, outcome="cancelled", exit_code=-15,
        reason="cancelled by the control plane",
    )  # fmt: skip
    body = member.get(f"/api/v1/jobs/{running.pk}/").json()
    assert body["status"] == "cancelled" and body["failure_reason"] == "cancelled by user:member"

    admin_cancelled = job_submit(org=world.org, config=config)
    job_cancel(job=admin_cancelled, actor="admin:root")
    admin_cancelled.refresh_from_db()
    assert admin_cancelled.failure_reason == "cancelled by admin:root before it ran"


# ---- rough edges: paths, limits, filters, ids --------------------------------------------------------


@pytest.mark.parametrize("debug", [False, True])
def test_a_path_without_its_trailing_slash_answers_like_the_path_with_it(
    world: World, settings: object, debug: bool
) -> None:
    settings.DEBUG = debug  # type: ignore[attr-defined]  # `make dev` runs with DEBUG on
    job_config(world.org, world.machine_type, "nightly")
    member = world.client("member")
    submitted = member.post("/api/v1/jobs", {"config": "nightly"}, format="json")
    assert submitted.status_code == 201, submitted.content  # not a 500, not a 301 to a GET
    job_id = submitted.json()["id"]
    listed = member.get("/api/v1/jobs")
    assert listed.status_code == 200 and [j["id"] for j in listed.json()["results"]] == [job_id]
    assert member.get(f"/api/v1/jobs/{job_id}").json()["id"] == job_id
    cancelled = member.post(f"/api/v1/jobs/{job_id}/cancel")
    assert cancelled.status_code == 202 and cancelled.json()["status"] == "cancelled"
    assert member.get("/api/v1/nothing-here").json()["code"] == "not_found"


def test_a_body_too_large_names_the_limit(world: World, settings: object) -> None:
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1_000_000  # type: ignore[attr-defined]
    answer = world.client("member").post(
        "/api/v1/jobs/", data='{"config": "' + "x" * 1_000_001 + '"}', content_type="application/json"
    )
    assert answer.status_code == 413 and answer.json()["code"] == "payload_too_large"
    assert answer.json()["detail"] == "the request body may have at most 1,000,000 bytes (976 KiB)"


def test_a_filter_value_that_is_not_a_choice_lists_the_choices(world: World) -> None:
    answer = world.client("viewer").get("/api/v1/jobs/?status=sucess")
    assert answer.status_code == 400 and answer.json()["code"] == "invalid"
    detail = answer.json()["detail"]
    assert detail.startswith("status: 'sucess' is not one of ")
    assert "succeeded" in detail and "cancelled" in detail and "queued" in detail
    pools = world.client("viewer").get("/api/v1/pools/?status=redy")
    assert pools.status_code == 400 and "ready" in pools.json()["detail"]


def test_an_unknown_ordering_or_a_limit_that_is_not_a_number_is_refused(world: World) -> None:
    viewer = world.client("viewer")
    ordering = viewer.get("/api/v1/jobs/?ordering=bogus")
    assert ordering.status_code == 400 and ordering.json()["code"] == "invalid"
    assert ordering.json()["detail"] == (
        "ordering: cannot order by 'bogus'; order by created_at, finished_at, priority or status "
        "(a leading - for descending, e.g. -created_at)"
    )
    assert viewer.get("/api/v1/jobs/?ordering=-priority,created_at").status_code == 200
    for query, field in (("limit=abc", "limit"), ("limit=0", "limit"), ("offset=-1", "offset")):
        answer = viewer.get(f"/api/v1/jobs/?{query}")
        assert answer.status_code == 400, query
        assert answer.json()["fields"] == {field: [answer.json()["detail"].removeprefix(f"{field}: ")]}
        assert "whole number" in answer.json()["detail"], answer.json()
    assert viewer.get("/api/v1/jobs/?limit=5&offset=0").status_code == 200


def test_a_body_that_is_not_json_says_where_in_plain_words(world: World) -> None:
    answer = world.client("member").post("/api/v1/jobs/", data='{"config": ', content_type="application/json")
    assert answer.status_code == 400 and answer.json()["code"] == "parse_error"
    assert answer.json()["detail"] == (
        "the request body is not valid JSON: expecting a value at line 1, column 12"
    )
    trailing = world.client("member").post(
        "/api/v1/jobs/", data='{"config": "a",}', content_type="application/json"
    )
    assert trailing.json()["detail"] == (
        "the request body is not valid JSON: expecting a property name in double quotes at line 1, column 16"
    )


def test_a_short_id_in_a_path_says_the_api_takes_the_full_id(world: World) -> None:
    job = job_row(job_config(world.org, world.machine_type, "nightly"))
    viewer = world.client("viewer")
    short = str(job.pk)[:8]
    answer = viewer.get(f"/api/v1/jobs/{short}/")
    assert answer.status_code == 404 and answer.json()["code"] == "not_found"
    assert answer.json()["detail"] == (
        f"the API takes a job's full id, not its first digits: {short} is the start of {job.pk} "
        f"(GET /api/v1/jobs/{job.pk}/)"
    )
    none = viewer.get("/api/v1/jobs/0000abcd/").json()["detail"]
    assert none == "no job's id starts with 0000abcd (the API takes a job's full id)"
    assert viewer.get("/api/v1/jobs/nightly/").json()["detail"] == (
        "'nightly' is not a job id: the API takes a job's full id (a UUID)"
    )
    missing = "6f1c7c9e-0000-4000-8000-000000000000"
    assert viewer.get(f"/api/v1/jobs/{missing}/").json()["detail"] == f"no job with id {missing}"
    # another organization's job: exactly like a job that does not exist
    assert world.client("outsider").get(f"/api/v1/jobs/{short}/").json()["detail"] == (
        f"no job's id starts with {short} (the API takes a job's full id)"
    )


def test_an_env_too_large_is_refused_at_submission_naming_the_limit(world: World) -> None:
    """5,000 env keys were accepted (201) and the job then failed in its sandbox (bwrap: Exceeded
    maximum number of arguments): configurations and submissions are checked when they arrive."""
    admin, member = world.client("admin"), world.client("member")
    body = {"name": "big", "machine_type": "small", "command": "true"}
    many = {f"K{i}": "v" for i in range(5000)}
    limit = "at most 256 variables and 131,072 bytes (128 KiB) of names and values"
    answer = admin.post("/api/v1/job-configs/", {**body, "env": many}, format="json")
    assert answer.status_code == 400 and answer.json()["code"] == "env_too_large"
    assert answer.json()["detail"] == (
        f"env: 5000 variables (28,890 bytes); a job configuration's env and secret_env together take {limit}"
    )
    half = {f"K{i}": "v" for i in range(200)}
    secrets = {f"S{i}": "v" for i in range(100)}
    together = admin.post("/api/v1/job-configs/", {**body, "env": half, "secret_env": secrets}, format="json")
    assert together.status_code == 400 and together.json()["code"] == "env_too_large"
    long = {f"K{i}": "x" * 30_000 for i in range(5)}
    bytes_ = admin.post("/api/v1/job-configs/", {**body, "env": long}, format="json")
    assert bytes_.status_code == 400 and "150,010 bytes" in bytes_.json()["detail"]
    assert not JobConfiguration.objects.exists()

    made = admin.post("/api/v1/job-configs/", {**body, "env": half}, format="json")
    assert made.status_code == 201, made.json()
    patched = admin.patch(f"/api/v1/job-configs/{made.json()['id']}/", {"env": many}, format="json")
    assert patched.status_code == 400 and patched.json()["code"] == "env_too_large"
    submitted = member.post("/api/v1/jobs/", {"config": "big", "env": many}, format="json")
    assert submitted.status_code == 400 and submitted.json()["code"] == "env_too_large"
    assert submitted.json()["detail"].startswith("env: 5000 variables")
    assert submitted.json()["detail"].endswith(f"a job's env and secret_env together take {limit}")
    merged = member.post(
        "/api/v1/jobs/", {"config": "big", "env": {"EXTRA": "1"}, "secret_env": secrets}, format="json"
    )
    assert merged.status_code == 400 and merged.json()["detail"].startswith("env: 301 variables")
    assert not Job.objects.exists()
    fits = member.post(
        "/api/v1/jobs/", {"config": "big", "env": {f"J{i}": "v" for i in range(56)}}, format="json"
    )
    assert fits.status_code == 201, fits.json()
