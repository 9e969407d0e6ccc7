"""The fake GitHub keeps GitHub's documented limits (testkit/github_fake.py says where each comes
from): points per endpoint, content creation, secondary answers with and without retry-after (and
a call too early recorded), primary limits per installation, deliveries paged by cursor, user
accounts without /orgs, the Default runner group serving private repositories only, a dead
runner's job failing after ten minutes; and the stand-in runner exits as actions/runner does."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.github_fake import FakeGitHub

REPO = "acme/app"


@pytest.fixture
def fake() -> Iterator[FakeGitHub]:
    github = FakeGitHub().start()
    github.add_installation(1, "acme", [REPO, "acme/site"], public=["acme/site"])
    with github.lock:
        github.tokens["t"] = (1, 1e12)
    try:
        yield github
    finally:
        github.stop()


def call(fake: FakeGitHub, method: str, path: str, body: Any = None) -> tuple[int, Any, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        fake.url + path,
        data,
        {"Authorization": "Bearer t", "Content-Type": "application/json"},
        method=method,
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            raw = answer.read()
            return answer.status, json.loads(raw) if raw else None, answer.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null"), exc.headers


def jit(fake: FakeGitHub, name: str, owner: str = "/orgs/acme") -> tuple[int, Any, Any]:
    body = {"name": name, "labels": ["x"], "runner_group_id": 1}
    return call(fake, "POST", f"{owner}/actions/runners/generate-jitconfig", body)


def test_content_creation_and_points_limits_answer_secondary_limits_in_each_style(fake: FakeGitHub) -> None:
    fake.limits["creations_per_minute"] = 3
    assert [jit(fake, f"r{i}")[0] for i in range(3)] == [201, 201, 201]
    answers = [jit(fake, "r9") for _ in range(3)]
    assert [a[0] for a in answers] == [403, 403, 429]  # retry-after, bare 403, bare 429 in turn
    assert "secondary rate limit" in answers[0][1]["message"]
    assert answers[0][2]["retry-after"] is not None and int(answers[0][2]["x-ratelimit-remaining"]) > 0
    assert len(fake.limit_violations) == 2  # called again sooner than its retry-after
    fake.limits["creations_per_minute"] = 80
    fake.limits["endpoint_points_per_minute"] = 3
    with fake.lock:
        fake._waits.clear()
    assert call(fake, "GET", "/repos/acme/app/actions/runners")[0] == 200
    limited = [call(fake, "GET", f"/repos/acme/{r}/actions/runners")[0] for r in ("site", "app", "site")]
    assert limited[0] == 200 and limited[1] == 200 and limited[2] in (403, 429)  # one endpoint, any repo
    assert {style for _, _, _, style in fake.limit_answers} >= {"retry_after", "bare_403"}


def test_deliveries_are_paged_by_cursor(fake: FakeGitHub) -> None:
    for _ in range(5):
        fake.queue_job(REPO, ["x"])
    _, page, more = fake._deliveries_page({"per_page": "2"})
    assert len(page) == 2 and 'rel="next"' in more["Link"]
    cursor = more["Link"].split("cursor=")[1].split(">")[0]
    _, second, _ = fake._deliveries_page({"per_page": "2", "cursor": cursor})
    assert [d["id"] for d in second] == sorted((d.id for d in fake.deliveries), reverse=True)[2:4]


def test_a_user_account_has_no_org_runners_and_the_default_group_serves_private_repositories(
    fake: FakeGitHub,
) -> None:
    fake.add_installation(1, "acme", [REPO, "acme/site"], public=["acme/site"], account_type="User")
    assert jit(fake, "org-runner")[0] == 404
    fake.add_installation(1, "acme", [REPO, "acme/site"], public=["acme/site"])
    _, org_runner, _ = jit(fake, "org-runner")
    public_job = fake.queue_job("acme/site", ["x"])
    with fake.lock:
        runner = fake.runners[org_runner["runner"]["id"]]
        assert fake._take(runner) is None  # the Default group: private repositories only
        assert fake.job(public_job).status == "queued"
    _, repo_runner, _ = jit(fake, "repo-runner", "/repos/acme/site")
    with fake.lock:
        assert fake._take(fake.runners[repo_runner["runner"]["id"]]).id == public_job
    assert FakeGitHub().lost_after == 600.0  # a dead runner's job fails after about ten minutes


def test_a_runner_too_old_exits_7_only_with_the_exit_code_variable(fake: FakeGitHub, tmp_path: Path) -> None:
    run_sh = Path(__file__).resolve().parents[2] / "testkit" / "github_runner" / "run.sh"
    codes = []
    for env in (
        {},
        {"ACTIONS_RUNNER_RETURN_VERSION_DEPRECATED_EXIT_CODE": "1", "RUNNER_MANUALLY_TRAP_SIG": "1"},
    ):
        fake.runner_faults.append("deprecated")
        _, body, _ = jit(fake, f"old-{len(codes)}")
        config = base64.b64decode(body["encoded_jit_config"])
        assert json.loads(config)["fault"] == "deprecated"
        done = subprocess.run(
            ["/bin/sh", str(run_sh)],
            env={
                "PATH": os.path.dirname(sys.executable) + ":/usr/bin:/bin",
                "ACTIONS_RUNNER_INPUT_JITCONFIG": body["encoded_jit_config"],
                **env,
            },
            cwd=tmp_path,
            capture_output=True,
            timeout=60,
        )
        codes.append(done.returncode)
    assert codes == [0, 7]  # silent without it (run.sh's "exit 0"), 7 with it
