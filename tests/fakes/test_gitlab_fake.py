"""The fake GitLab treats a runner's token as GitLab does (gitlabhq ``lib/api/ci/runner.rb`` and
``lib/api/ci/helpers/runner.rb``): a live token takes any pending job it matches, however many its
runner runs already; a paused runner's token gets 204 and no job; a deleted runner's token gets
403; a running job keeps reporting with its own job token after its runner is deleted. It keeps
GitLab.com's runner cap over seven days, sends no job tags in its Job events, and the stand-in
gitlab-runner calls only what ``run-single`` calls, as its runner manager (system id)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
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


def test_job_events_carry_no_job_tags(fake: FakeGitLab) -> None:
    """Item 8: gitlabhq lib/gitlab/data_builder/build.rb has the runner's tags only."""
    fake.queue_job("acme/app", TAGS)
    bodies = [json.loads(d.body) for d in fake.deliveries]
    assert bodies and all("build_tags" not in b and "tag_list" not in b for b in bodies)


def test_the_runner_cap_counts_runners_created_or_active_in_seven_days(fake: FakeGitLab) -> None:
    clock = [1_000_000.0]
    fake.now = lambda: clock[0]
    fake.runner_cap = 2
    first, _ = runner(fake)
    runner(fake)
    body = {"runner_type": "project_type", "project_id": 12, "tag_list": TAGS}
    status, _ = call(fake, "POST", "/api/v4/user/runners", body, **{"PRIVATE-TOKEN": TOKEN})
    assert status == 400 and fake.cap_refusals == 1
    assert call(fake, "DELETE", f"/api/v4/runners/{first}", **{"PRIVATE-TOKEN": TOKEN})[0] == 204
    assert (
        call(fake, "POST", "/api/v4/user/runners", body, **{"PRIVATE-TOKEN": TOKEN})[0] == 400
    )  # deleted counts
    clock[0] += 7 * 86400 + 1
    assert call(fake, "POST", "/api/v4/user/runners", body, **{"PRIVATE-TOKEN": TOKEN})[0] == 201


def _stand_in(tmp_path: Path) -> list[str]:
    """The stand-in's ``run-single`` for one job, with the runner ``x`` of ``config.toml``."""
    stand_in = Path(__file__).resolve().parents[2] / "testkit" / "gitlab_runner" / "runner.py"
    config = str(tmp_path / "config.toml")
    return [sys.executable, str(stand_in), "run-single", "--config", config, "--runner", "x"] + [
        "--max-builds",
        "1",
        "--wait-timeout",
        "20",
    ]


def _configure(fake: FakeGitLab, tmp_path: Path) -> None:
    _, token = runner(fake)
    (tmp_path / ".runner_system_id").write_text("s_0123456789ab\n")
    (tmp_path / "config.toml").write_text(
        f'[[runners]]\nname = "x"\nurl = "{fake.url}"\ntoken = "{token}"\nexecutor = "shell"\n'
        f'builds_dir = "{tmp_path}/builds"\n'
    )


def test_the_stand_in_runner_calls_only_what_run_single_does(fake: FakeGitLab, tmp_path: Path) -> None:
    job = fake.queue_job("acme/app", TAGS, ["true"])
    _configure(fake, tmp_path)
    done = subprocess.run(_stand_in(tmp_path), capture_output=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stdout
    assert fake.job(job).status == "success" and fake.job(job).system_id == "s_0123456789ab"
    routes = {route for _, route, _ in fake.runner_calls}
    assert routes <= {"/api/v4/jobs/request", "/api/v4/jobs/{id}/trace", "/api/v4/jobs/{id}"}
    assert "/api/v4/runners/verify" not in routes  # run-single never verifies (commands/single.go)


def test_the_stand_in_keeps_a_quiet_job_alive_and_stops_a_canceled_one(
    fake: FakeGitLab, tmp_path: Path
) -> None:
    """Like gitlab-runner's trace watcher, it updates the job on an interval from its start,
    whatever the script does: a job quiet for longer than GitLab's stuck limit succeeds; a job
    canceled at GitLab is stopped in its running line, and the runner does not report it."""
    fake.lost_after = 3.0
    _configure(fake, tmp_path)
    quiet = fake.queue_job("acme/app", TAGS, ["sleep 5", "true"])
    done = subprocess.run(_stand_in(tmp_path), capture_output=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0 and fake.job(quiet).status == "success", done.stdout

    long = fake.queue_job("acme/app", TAGS, ["sleep 60"])
    runner = subprocess.Popen(_stand_in(tmp_path), stdout=subprocess.PIPE, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 20
        while fake.job(long).status != "running" and time.monotonic() < deadline:
            time.sleep(0.1)
        fake.cancel_job(long)
        out, _ = runner.communicate(timeout=15)  # its keep-alive is refused within an interval
    finally:
        runner.kill()
    assert b"the job was canceled" in out and fake.job(long).status == "canceled"
