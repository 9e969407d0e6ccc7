"""The fake GitLab treats a runner's token as GitLab does (gitlabhq ``lib/api/ci/runner.rb`` and
``lib/api/ci/helpers/runner.rb``): a live token takes any pending job it matches, however many its
runner runs already; a paused runner's token gets 204 and no job; a deleted runner's token gets
403; a running job keeps reporting with its own job token after its runner is deleted."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from testkit.gitlab_fake import FakeGitLab

TOKEN = "glpat-fake-test"
TAGS = ["catacloud", "linux"]


@pytest.fixture
def fake() -> Iterator[FakeGitLab]:
    gitlab = FakeGitLab(token=TOKEN).start()
    gitlab.add_project(12, "acme/app")
    try:
        yield gitlab
    finally:
        gitlab.stop()


def call(fake: FakeGitLab, method: str, path: str, body: Any = None, **headers: str) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        fake.url + path, data, {"Content-Type": "application/json", **headers}, method=method
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            raw = answer.read()
            return answer.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, None


def runner(fake: FakeGitLab) -> tuple[int, str]:
    body = {"runner_type": "project_type", "project_id": 12, "tag_list": TAGS, "run_untagged": False}
    status, created = call(fake, "POST", "/api/v4/user/runners", body, **{"PRIVATE-TOKEN": TOKEN})
    assert status == 201
    return created["id"], created["token"]


def ask(fake: FakeGitLab, token: str) -> tuple[int, Any]:
    return call(fake, "POST", "/api/v4/jobs/request", {"token": token})


def test_a_live_runner_token_takes_every_job_it_asks_for(fake: FakeGitLab) -> None:
    _, token = runner(fake)
    first, second = (fake.queue_job("acme/app", TAGS) for _ in range(2))
    assert ask(fake, token)[1]["id"] == first
    assert ask(fake, token)[1]["id"] == second  # while the first runs: GitLab counts none
    assert {fake.job(first).status, fake.job(second).status} == {"running"}


def test_a_paused_runner_gets_no_job_and_a_deleted_one_is_refused(fake: FakeGitLab) -> None:
    runner_id, token = runner(fake)
    admin = {"PRIVATE-TOKEN": TOKEN}
    job = fake.queue_job("acme/app", TAGS)
    assert call(fake, "PUT", f"/api/v4/runners/{runner_id}", {"paused": True}, **admin)[0] == 200
    assert ask(fake, token)[0] == 204 and fake.job(job).status == "pending"
    assert call(fake, "POST", "/api/v4/runners/verify", {"token": token})[0] == 200  # still valid
    assert call(fake, "DELETE", f"/api/v4/runners/{runner_id}", **admin)[0] == 204
    assert ask(fake, token)[0] == 403 and fake.job(job).status == "pending"
    assert call(fake, "POST", "/api/v4/runners/verify", {"token": token})[0] == 403


def test_a_running_job_outlives_its_deleted_runner(fake: FakeGitLab) -> None:
    fake.lost_after = 1.5
    runner_id, token = runner(fake)
    job = fake.queue_job("acme/app", TAGS)
    taken = ask(fake, token)[1]
    assert call(fake, "DELETE", f"/api/v4/runners/{runner_id}", **{"PRIVATE-TOKEN": TOKEN})[0] == 204
    for _ in range(3):  # updated more often than lost_after: alive, with no runner
        status, _ = call(fake, "PATCH", f"/api/v4/jobs/{job}/trace", {}, **{"JOB-TOKEN": taken["token"]})
        assert status == 202
        time.sleep(0.8)
    assert fake.job(job).status == "running"
    answer = call(fake, "GET", f"/api/v4/projects/12/jobs/{job}", **{"PRIVATE-TOKEN": TOKEN})[1]
    assert answer["runner"] is None  # GitLab names no runner once it is deleted
    assert call(fake, "PUT", f"/api/v4/jobs/{job}", {"token": taken["token"], "state": "success"})[0] == 200
    assert fake.job(job).status == "success"
