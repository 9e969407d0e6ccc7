"""The client CLI (`catacloud jobs|pools|artifacts`) end to end: the installed `catacloud`
script in its own process against the live API; with a real worker, beat and agents where a
job must really run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from apps.jobs.models import Job
from apps.machines.models import MachineInstance
from testkit.processes import wait_for
from tests.conftest import World
from tests.e2e.conftest import Stack
from tests.e2e.test_jobs_and_agent import job_config

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

SCRIPT = Path(sys.executable).with_name("catacloud")  # the console script pip installed
CLI = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "catacloud.cli"]


class Cli:
    """Runs `catacloud …` as a user would: URL and token from the environment (or, with
    ``token=None``, from whatever ``extra_env`` says), a config directory of its own."""

    def __init__(self, url: str, tmp: Path) -> None:
        self.url, self.tmp = url, tmp

    def env(self, token: str | None, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CATACLOUD_", "DJANGO_"))}
        env.update(XDG_CONFIG_HOME=str(self.tmp / "xdg"), CATACLOUD_URL=self.url, PYTHONUNBUFFERED="1")
        if token is not None:
            env["CATACLOUD_TOKEN"] = token
        env.update(extra)
        return env

    def __call__(
        self, token: str | None, *args: str, timeout: float = 120, **extra: str
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI, *args],
            env=self.env(token, **extra),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.tmp,
        )

    def popen(self, token: str, *args: str, out: Path, err: Path) -> subprocess.Popen:
        # As a terminal starts it: Ctrl-C's signal at its default and not blocked. A child
        # inherits an ignored or blocked SIGINT, and Python then never raises KeyboardInterrupt:
        # in two full runs the watch slept through Ctrl-C with nothing on stderr (which earlier
        # test leaves this process so is not found yet).
        return subprocess.Popen(
            [*CLI, *args],
            env=self.env(token),
            stdout=out.open("w"),
            stderr=err.open("w"),
            cwd=self.tmp,
            preexec_fn=_sigint_default,
        )


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a blocked one is inherited too


@pytest.fixture
def cli(live_server: Any, tmp_path: Path) -> Cli:
    return Cli(live_server.url, tmp_path)


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


# ---- with real agents -----------------------------------------------------------------------------


def test_submit_by_name_follows_the_output_and_the_artifact_downloads(stack: Stack, cli: Cli) -> None:
    member = stack.world.tokens["member"]
    job_config(
        stack,
        "hello",
        'echo "hello $GREETING"; echo "$GREETING" > $CATACLOUD_OUTPUT_DIR/result.txt',
        reuse="reuse",
    )
    result = ok(cli(member, "jobs", "submit", "--config", "hello", "--env", "GREETING=world", "--follow"))
    assert "hello world" in result.stdout  # the job's own output, streamed
    assert (
        re.search(r"^… \w+", result.stderr, re.M) and "succeeded" in result.stderr
    )  # progress, then the summary
    job = Job.objects.get(config__name="hello")
    assert job.status == "succeeded" and job.env == {"GREETING": "world"}
    assert str(job.pk) in result.stderr

    job_id = str(job.pk)
    listed = wait_for(
        lambda: json.loads(ok(cli(member, "artifacts", "ls", job_id, "--json")).stdout),
        30,
        "the output to be uploaded",
        interval=0.5,
    )
    assert [a["name"] for a in listed] == ["result.txt"]
    ok(cli(member, "artifacts", "get", job_id, "result.txt", "-o", "out.txt"))
    assert (cli.tmp / "out.txt").read_text() == "world\n"
    missing = cli(member, "artifacts", "get", job_id, "nope.txt")
    assert missing.returncode == 1 and "not_found" in missing.stderr and "HTTP 404" in missing.stderr

    table = ok(cli(member, "jobs", "ls")).stdout.splitlines()
    assert table[0].split()[:3] == ["ID", "CONFIG", "STATUS"]
    assert any(line.split()[:3] == [job_id[:8], "hello", "succeeded"] for line in table[1:]), table
    rows = json.loads(ok(cli(member, "jobs", "ls", "--json", "--status", "succeeded")).stdout)
    assert [(r["id"], r["status"]) for r in rows] == [(job_id, "succeeded")]


def test_wait_exits_with_the_jobs_exit_code(stack: Stack, cli: Cli) -> None:
    job_config(stack, "fails", "echo oops; exit 3", reuse="reuse")
    result = cli(stack.world.tokens["member"], "jobs", "submit", "--config", "fails", "--wait")
    assert result.returncode == 3, result.stderr
    assert "failed (exit code 3)" in result.stdout
    assert Job.objects.get(config__name="fails").status == "failed"


def test_logs_follow_a_running_job_until_it_is_cancelled(stack: Stack, cli: Cli) -> None:
    member = stack.world.tokens["member"]
    job_config(stack, "long", "echo started; sleep 300")
    submitted = json.loads(ok(cli(member, "jobs", "submit", "--config", "long", "--json")).stdout)
    assert submitted["status"] == "queued" and submitted["config_name"] == "long"
    job_id = submitted["id"]
    assert Job.objects.get(pk=job_id).idempotency_key  # the CLI names its submit: a retry queues none
    out, err = cli.tmp / "logs.out", cli.tmp / "logs.err"
    follower = cli.popen(member, "jobs", "logs", job_id, "-f", out=out, err=err)
    try:
        wait_for(lambda: "started" in out.read_text(), 60, "the follower to print the job's output", 0.2)
        assert follower.poll() is None  # still following: the job runs on
        cancelled = ok(cli(member, "jobs", "cancel", job_id))
        assert f"job {job_id}" in cancelled.stdout and "cancel" in cancelled.stdout
        assert follower.wait(timeout=30) == 0
    finally:
        if follower.poll() is None:
            follower.kill()
    assert f"job {job_id} cancelled" in err.read_text()
    assert out.read_text().count("started") == 1  # each line once
    assert Job.objects.get(pk=job_id).status == "cancelled"


def test_follow_carries_on_across_a_requeue(stack: Stack, cli: Cli) -> None:
    """The machine dies mid-job: the job is requeued and finishes elsewhere; --follow shows
    both attempts' output, once each, and ends with the job's success."""
    job_config(
        stack,
        "resilient",
        'echo attempt-$CATACLOUD_ATTEMPT; if [ "$CATACLOUD_ATTEMPT" = 1 ]; then sleep 300; fi; echo finished',
    )
    out, err = cli.tmp / "follow.out", cli.tmp / "follow.err"
    args = ("jobs", "submit", "--config", "resilient", "--follow")
    follower = cli.popen(stack.world.tokens["member"], *args, out=out, err=err)
    try:
        wait_for(lambda: "attempt-1" in out.read_text(), 60, "the first attempt's output", 0.2)
        stack.agent_process(str(Job.objects.get().instance_id)).kill()  # the machine dies: no goodbye
        assert follower.wait(timeout=120) == 0, err.read_text()
    finally:
        if follower.poll() is None:
            follower.kill()
    assert out.read_text() == "attempt-1\nattempt-2\nfinished\n"
    progress = err.read_text()
    assert "--- attempt 2 ---" in progress and "succeeded" in progress
    job = Job.objects.get()
    assert job.status == "succeeded" and job.attempt == 2


def test_pools_ls_acquire_and_release(stack: Stack, cli: Cli) -> None:
    member = stack.world.tokens["member"]
    body = {"name": "ci", "machine_type": str(stack.world.machine_type.pk), "target_size": 1, "max_size": 1}
    pool = stack.api("admin").post("/api/v1/pools/", body, format="json").json()
    stack.wait(
        lambda: stack.api("viewer").get(f"/api/v1/pools/{pool['id']}/").json()["ready_count"] == 1,
        60,
        "a ready member",
    )
    listed = ok(cli(member, "pools", "ls")).stdout.splitlines()
    assert listed[0].split()[:3] == ["NAME", "ID", "STATUS"]
    assert listed[1].split()[:4] == ["ci", pool["id"][:8], "ready", "small"]  # the type by name

    claim = json.loads(ok(cli(member, "pools", "acquire", "ci", "--by", "runner-7", "--json")).stdout)
    instance = MachineInstance.objects.get(pk=claim["instance"]["id"])
    assert instance.status == "claimed" and instance.claimed_by == "runner-7"
    assert str(instance.claim_id) == claim["claim_id"]

    empty = cli(member, "pools", "acquire", pool["id"])  # max_size 1: nothing refills it
    assert empty.returncode == 1
    assert "pool_empty" in empty.stderr and "HTTP 409" in empty.stderr and empty.stdout == ""

    released = ok(cli(member, "pools", "release", str(instance.pk)))
    assert f"instance {instance.pk} released" in released.stdout
    instance.refresh_from_db()
    assert instance.status in ("terminating", "terminated")


# ---- against the live API alone -------------------------------------------------------------------


def test_api_errors_are_shown_with_a_nonzero_exit_and_never_the_token(
    tworld: World, cli: Cli, live_server: Any
) -> None:
    member, viewer = tworld.tokens["member"], tworld.tokens["viewer"]
    unknown = cli(member, "jobs", "submit", "--config", "no-such-config")
    assert unknown.returncode == 1 and unknown.stdout == ""
    assert "unknown_config" in unknown.stderr and "HTTP 400" in unknown.stderr
    assert "config: does not exist" in unknown.stderr
    as_json = cli(member, "jobs", "submit", "--config", "no-such-config", "--json")
    assert as_json.returncode == 1 and json.loads(as_json.stderr)["code"] == "unknown_config"
    assert not Job.objects.exists()

    wrong = cli("cc_wrong-token-value", "jobs", "ls")
    assert wrong.returncode == 1 and "HTTP 401" in wrong.stderr and "CATACLOUD_TOKEN" in wrong.stderr
    assert "cc_wrong-token-value" not in wrong.stdout + wrong.stderr
    none = cli(None, "jobs", "ls")
    assert none.returncode == 2 and "no API token" in none.stderr
    bad = cli(member, "jobs", "submit", "--config", "x", "--env", "NOEQUALS")
    assert bad.returncode == 2 and "NAME=VALUE" in bad.stderr
    # said at once, not after a minute of retries (those ride out a restart once it answered)
    down = cli(member, "jobs", "ls", CATACLOUD_URL="http://127.0.0.1:9", timeout=20)
    assert down.returncode == 1 and "cannot reach http://127.0.0.1:9" in down.stderr
    assert member not in down.stderr

    # A profile from the config file; a viewer may read but not cancel.
    tworld.org.job_configs.create(name="nightly", machine_type=tworld.machine_type, command="make")
    config = cli.tmp / "xdg" / "catacloud" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(f'[lab]\nurl = "{live_server.url}"\ntoken = "{member}"\n')
    config.chmod(0o600)
    submitted = ok(cli(None, "jobs", "submit", "--config", "nightly", "--profile", "lab"))
    job = Job.objects.get()
    assert submitted.stdout.strip() == f"job {job.pk} queued (config nightly)"
    assert submitted.stderr == ""  # no warning: the file is private
    before = Job.objects.get().status  # queued, or waiting for the machine its submit asked for
    refused = cli(viewer, "jobs", "cancel", str(job.pk))
    assert refused.returncode == 1 and "HTTP 403" in refused.stderr
    assert Job.objects.get().status == before != "cancelled"
    ok(cli(None, "jobs", "cancel", str(job.pk), CATACLOUD_PROFILE="lab"))
    wait_for(lambda: Job.objects.get().status == "cancelled", 10, "the queued job to be cancelled")


def test_wait_gives_up_after_its_timeout(tworld: World, cli: Cli) -> None:
    tworld.org.job_configs.create(name="stuck", machine_type=tworld.machine_type, command="true")
    started = time.monotonic()
    # No worker runs here: the machine its submit asked for never boots, the job never runs.
    result = cli(tworld.tokens["member"], "jobs", "submit", "--config", "stuck", "--wait", "--timeout", "2")
    status = Job.objects.get().status
    assert status in ("queued", "waiting_for_machine")
    assert result.returncode == 1 and f"still {status} after 2s; stopped waiting" in result.stderr
    assert f"… {status}" in result.stderr  # the progress line
    assert time.monotonic() - started < 30
