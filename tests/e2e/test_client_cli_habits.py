"""The client CLI with the habits of gh and kubectl (issue 28): short ids, global flags before or
after the command, "did you mean", ``--version``, ``auth login``, ``configs create``,
``pools create``, ``jobs show`` with events, stderr under ``--follow``, no traceback from a
server that is not Catacloud, and a token that only goes to its own server. The installed
``catacloud`` script in its own process against the live API (and real agents where a job
must run)."""

from __future__ import annotations

import json
import subprocess
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import catacloud
from apps.jobs.models import Job, JobConfiguration
from apps.pools.models import InstancePool
from testkit.builders import job_config, job_row
from tests.conftest import World
from tests.e2e.conftest import Stack
from tests.e2e.test_client_cli import CLI, Cli, ok
from tests.e2e.test_jobs_and_agent import job_config as stack_job_config

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def cli(live_server: Any, tmp_path: Path) -> Cli:
    return Cli(live_server.url, tmp_path)


def test_short_ids_and_unique_prefixes_name_jobs(tworld: World, cli: Cli) -> None:
    config = job_config(tworld.org, tworld.machine_type, "nightly")
    one = job_row(config, id=uuid.UUID("abcd1111-0000-4000-8000-000000000001"), status="queued")
    job_row(config, id=uuid.UUID("abcd2222-0000-4000-8000-000000000002"), status="queued")
    member = tworld.tokens["member"]

    table = ok(cli(member, "jobs", "ls")).stdout.splitlines()
    assert {line.split()[0] for line in table[1:]} == {"abcd1111", "abcd2222"}  # as the console shows them
    shown = ok(cli(member, "jobs", "show", "abcd1111"))
    assert shown.stdout.startswith(f"job      {one.pk}\n")
    assert ok(cli(member, "jobs", "show", "ABCD-1111", "--json")).stdout.count(str(one.pk)) >= 1

    ambiguous = cli(member, "jobs", "show", "abcd")
    assert ambiguous.returncode == 2
    assert "abcd is the start of several job ids (abcd1111, abcd2222): give more of it" in ambiguous.stderr
    missing = cli(member, "jobs", "cancel", "ffff0000")
    assert (
        missing.returncode == 1
        and "no job with an id starting ffff0000 (not_found, HTTP 404)" in missing.stderr
    )
    too_short = cli(member, "jobs", "logs", "ab")
    assert too_short.returncode == 2 and "at least its first 4 hex digits" in too_short.stderr
    ok(cli(member, "jobs", "cancel", "abcd1111"))
    assert Job.objects.get(pk=one.pk).status == "cancelled"


def test_global_flags_before_or_after_the_command_and_the_version(
    tworld: World, cli: Cli, live_server: Any
) -> None:
    job_config(tworld.org, tworld.machine_type, "nightly")
    member = tworld.tokens["member"]
    no_env_url = {"CATACLOUD_URL": ""}  # only the flag names the server
    before = ok(cli(member, "--url", live_server.url, "--json", "configs", "ls", **no_env_url))
    after = ok(cli(member, "configs", "ls", "--url", live_server.url, "--json", **no_env_url))
    assert json.loads(before.stdout) == json.loads(after.stdout) != []
    down = cli(member, "--url", "http://127.0.0.1:9", "jobs", "ls", timeout=20, **no_env_url)
    assert down.returncode == 1 and "cannot reach http://127.0.0.1:9" in down.stderr

    version = ok(cli(None, "--version"))
    assert version.stdout.startswith(f"catacloud {catacloud.__version__}")


def test_typos_get_one_clear_message_with_a_suggestion(tworld: World, cli: Cli) -> None:
    member = tworld.tokens["member"]
    follow = cli(member, "jobs", "submit", "--config", "x", "--follw")
    assert follow.returncode == 2
    assert "unrecognized arguments: --follw (did you mean --follow?)" in follow.stderr
    command = cli(member, "jbos", "ls")
    assert command.returncode == 2 and "(did you mean jobs?)" in command.stderr
    status = cli(member, "jobs", "ls", "--status", "runing")
    assert status.returncode == 2
    errors = [line for line in status.stderr.splitlines() if "error" in line]
    assert (
        len(errors) == 1
        and "invalid choice: 'runing'" in errors[0]
        and "(did you mean running?)" in errors[0]
    )
    assert not Job.objects.exists()


def test_the_clients_job_statuses_are_the_apis() -> None:
    """`jobs ls --status` checks its choices on the client (one message for a typo): the same
    list as the server's."""
    from apps.jobs.choices import JobStatus
    from catacloud.client.commands import JOB_STATUSES

    assert sorted(JOB_STATUSES) == sorted(JobStatus.values)


def test_help_has_no_literal_double_backticks(cli: Cli) -> None:
    for command in ([], ["jobs"], ["jobs", "submit"], ["pools", "create"], ["auth", "login"], ["agent"]):
        shown = ok(cli(None, *command, "--help"))
        assert "usage: catacloud" in shown.stdout
        assert "``" not in shown.stdout, command


def test_configs_and_pools_are_created_by_machine_type_name(tworld: World, cli: Cli) -> None:
    admin, member = tworld.tokens["admin"], tworld.tokens["member"]
    made = ok(
        cli(
            admin, "configs", "create", "unit-tests", "--machine-type", "small", "--command", "make test",
            "--env", "CI=1", "--timeout", "600", "--reuse", "reuse",
        )
    )  # fmt: skip
    config = JobConfiguration.objects.get(name="unit-tests")
    assert made.stdout.startswith(
        f"job configuration unit-tests {str(config.pk)[:8]} created (machine type small)"
    )
    assert (config.machine_type, config.command, config.env, config.timeout_seconds, config.reuse) == (
        tworld.machine_type, "make test", {"CI": "1"}, 600, "reuse",
    )  # fmt: skip
    listed = ok(cli(member, "configs", "ls")).stdout.splitlines()
    assert listed[1].split()[:3] == ["unit-tests", str(config.pk)[:8], "small"]

    ok(cli(admin, "pools", "create", "ci", "--machine-type", "small", "--size", "0", "--max", "4"))
    pool = InstancePool.objects.get(name="ci")
    assert (pool.machine_type, pool.target_size, pool.max_size) == (tworld.machine_type, 0, 4)
    table = ok(cli(member, "pools", "ls")).stdout.splitlines()
    assert table[1].split()[:4] == ["ci", str(pool.pk)[:8], pool.status, "small"]

    refused = cli(admin, "pools", "create", "big", "--machine-type", "large", "--size", "1")
    assert refused.returncode == 1
    assert refused.stderr.startswith("error: machine_type: no grant for large in organization acme")
    assert refused.stderr.count("no grant for large") == 1  # one message, not the same one twice
    viewer = cli(
        tworld.tokens["viewer"], "configs", "create", "x", "--machine-type", "small", "--command", "true"
    )
    assert viewer.returncode == 1 and "HTTP 403" in viewer.stderr

    # What a job needs instead of a type: the cheapest granted type with at least that.
    sized = ok(cli(admin, "configs", "create", "sized", "--requires", "cpus=2",
                   "--requires", "memory_mb=1024", "--command", "true"))  # fmt: skip
    assert "created (machine type small)" in sized.stdout
    assert "requires cpus=2 memory_mb=1024" in ok(cli(member, "configs", "show", "sized")).stdout
    ok(cli(admin, "configs", "update", "sized", "--no-requires", "--machine-type", "small"))
    assert "requires" not in ok(cli(member, "configs", "show", "sized")).stdout
    too_big = cli(admin, "configs", "create", "huge", "--requires", "cpus=999", "--command", "true")
    assert too_big.returncode == 1 and "the largest is small (2 cpus" in too_big.stderr
    odd = cli(admin, "configs", "create", "odd", "--requires", "arch=arm64", "--requires", "disk=nvme",
              "--command", "true")  # fmt: skip
    assert odd.returncode == 1 and "has arch arm64, labels disk=nvme" in odd.stderr
    neither = cli(admin, "configs", "create", "bare", "--command", "true")
    assert neither.returncode != 0 and "--machine-type TYPE, or --requires" in neither.stderr


def test_jobs_show_ends_with_the_events_and_says_who_cancelled(tworld: World, cli: Cli) -> None:
    job_config(tworld.org, tworld.machine_type, "nightly")
    member = tworld.tokens["member"]
    job_id = json.loads(ok(cli(member, "jobs", "submit", "--config", "nightly", "--json")).stdout)["id"]
    ok(cli(member, "jobs", "cancel", job_id[:8]))
    shown = ok(cli(member, "jobs", "show", job_id[:8])).stdout
    summary, events = shown.split("\nevents:\n")
    assert "reason   cancelled by user:member before it ran" in summary
    kinds = [line.split()[1] for line in events.splitlines()[1:]]
    assert kinds[0] == "job.queued" and kinds[-1] == "job.finished", events
    assert "user:member" in events.splitlines()[-1]


def test_a_success_after_a_requeue_shows_the_requeue_as_history_not_as_its_reason(
    tworld: World, cli: Cli
) -> None:
    config = job_config(tworld.org, tworld.machine_type, "nightly")
    job = job_row(config, status="succeeded", attempt=2, requeue_reason="machine_terminated", exit_code=0)
    shown = ok(cli(tworld.tokens["viewer"], "jobs", "show", str(job.pk))).stdout
    assert "requeued 1 (last: machine_terminated)" in shown
    assert "reason" not in shown.split("\nevents:")[0]
    table = ok(cli(tworld.tokens["viewer"], "jobs", "ls")).stdout
    assert "machine_terminated" not in table


def test_auth_login_checks_and_stores_a_token_for_its_url(tworld: World, cli: Cli, live_server: Any) -> None:
    member = tworld.tokens["member"]
    config = cli.tmp / "xdg" / "catacloud" / "config.toml"
    login = ["auth", "login", "--url", live_server.url, "--profile", "lab"]

    wrong = subprocess.run(
        [*CLI, *login], input="cc_wrong\n", env=cli.env(None), capture_output=True, text=True, timeout=60
    )
    assert wrong.returncode == 1 and "HTTP 401" in wrong.stderr and "the token was not stored" in wrong.stderr
    assert not config.exists()

    right = subprocess.run(
        [*CLI, *login], input=f"{member}\n", env=cli.env(None), capture_output=True, text=True, timeout=60
    )
    assert right.returncode == 0, right.stderr
    assert f"logged in to {live_server.url}: token checked (machine types: small)" in right.stdout
    assert config.stat().st_mode & 0o777 == 0o600 and member not in right.stdout + right.stderr
    # nothing in the environment but the URL: the stored login is found by it
    status = ok(cli(None, "auth", "status"))
    assert f"{live_server.url}: token from profile 'lab'" in status.stdout
    job_config(tworld.org, tworld.machine_type, "nightly")
    ok(cli(None, "jobs", "submit", "--config", "nightly"))
    assert Job.objects.get().submitted_by.username == "member"


# ---- servers that are not this one ---------------------------------------------------------------


class _Recorder(BaseHTTPRequestHandler):
    """Answers every GET with ``body`` and records the Authorization headers it was sent."""

    body = b"{}"
    content_type = "application/json"
    status = 200
    seen: list[str | None]

    def do_GET(self) -> None:
        self.seen.append(self.headers.get("Authorization"))
        self.send_response(self.status)
        self.send_header("Content-Type", self.content_type)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def other_server() -> Iterator[tuple[str, type[_Recorder]]]:
    handler = type("Handler", (_Recorder,), {"seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_that_is_not_catacloud_gets_no_traceback(cli: Cli, other_server: Any) -> None:
    url, handler = other_server
    for body, content_type, status in ((b'{"hello": "world"}', "application/json", 200),
                                       (b"<html>Not Found</html>", "text/html", 404)):  # fmt: skip
        handler.body, handler.content_type, handler.status = body, content_type, status
        for args in (["jobs", "ls"], ["pools", "ls"], ["jobs", "show", "abcd1234"]):
            result = cli("cc_anything", *args, CATACLOUD_URL=url)
            assert result.returncode == 1, (args, result.stderr)
            assert "Traceback" not in result.stderr
            assert "Catacloud server?" in result.stderr, result.stderr


def test_the_profiles_token_is_not_sent_to_another_url(tworld: World, cli: Cli, other_server: Any) -> None:
    url, handler = other_server
    config = cli.tmp / "xdg" / "catacloud" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(f'[default]\nurl = "{cli.url}"\ntoken = "{tworld.tokens["member"]}"\n')
    config.chmod(0o600)
    ok(cli(None, "jobs", "ls", CATACLOUD_URL=cli.url))  # its own server: fine
    elsewhere = cli(None, "jobs", "ls", CATACLOUD_URL=url)
    assert elsewhere.returncode == 2
    assert f"no API token for {url}: profile 'default' holds a token for {cli.url}" in elsewhere.stderr
    flagged = cli(None, "--url", url, "jobs", "ls")
    assert flagged.returncode == 2
    assert handler.seen == []  # the other server never heard from us
    config.write_text(f'[default]\nurl = "{cli.url}"\ntoken_file = "{cli.tmp / "token"}"\n')
    (cli.tmp / "token").write_text(tworld.tokens["member"])
    (cli.tmp / "token").chmod(0o644)
    warned = ok(cli(None, "jobs", "ls"))
    assert f"the token file {cli.tmp / 'token'} may be read by others (chmod 600" in warned.stderr


def test_a_401_from_a_server_that_is_not_catacloud_is_not_blamed_on_the_token(
    tworld: World, cli: Cli, other_server: Any
) -> None:
    url, handler = other_server
    drf = b'{"detail": "Authentication credentials were not provided."}'  # another DRF app
    for body, content_type in ((drf, "application/json"), (b"<html>401</html>", "text/html")):
        handler.body, handler.content_type, handler.status = body, content_type, 401
        result = cli("cc_anything", "jobs", "ls", CATACLOUD_URL=url)
        assert result.returncode == 1 and "HTTP 401" in result.stderr
        assert "CATACLOUD_TOKEN" not in result.stderr, result.stderr
        assert (
            f"{url} answered 401 without Catacloud's error format: is it a Catacloud server?" in result.stderr
        )
    wrong = cli("cc_wrong-token-value", "jobs", "ls")  # Catacloud's own 401: the token
    assert wrong.returncode == 1 and "check CATACLOUD_TOKEN" in wrong.stderr


def test_logs_of_an_attempt_the_job_never_had_say_so(tworld: World, cli: Cli) -> None:
    job = job_row(job_config(tworld.org, tworld.machine_type, "nightly"), status="succeeded", attempt=1)
    for follow in ([], ["-f"]):
        result = cli(tworld.tokens["viewer"], "jobs", "logs", *follow, "--attempt", "2", str(job.pk)[:8])
        assert result.returncode == 1, (follow, result.stderr)
        assert f"attempt: job {job.pk} has had 1 attempt; attempt takes 1 to 1" in result.stderr
    ok(cli(tworld.tokens["viewer"], "jobs", "logs", "--attempt", "1", str(job.pk)))


def test_an_env_too_large_is_refused_when_submitted_naming_the_limit(tworld: World, cli: Cli) -> None:
    job_config(tworld.org, tworld.machine_type, "nightly")
    env = [arg for i in range(300) for arg in ("--env", f"K{i}=v")]
    result = cli(tworld.tokens["member"], "jobs", "submit", "--config", "nightly", *env)
    assert result.returncode == 1
    assert "at most 256 variables and 131,072 bytes (128 KiB)" in result.stderr
    assert "(env_too_large, HTTP 400)" in result.stderr
    assert not Job.objects.exists()


def test_pools_drain_and_delete_configs_delete_instances_and_auth_logout(
    tworld: World, cli: Cli, live_server: Any
) -> None:
    from apps.machines.models import MachineInstance
    from apps.pools.services import pool_create
    from testkit.builders import fake_machine_type, idle_machine, ready_members

    admin = tworld.tokens["admin"]
    fake, _ = fake_machine_type(tworld.org, grant={"max_pool_size": 5, "max_instances": 5})
    pool = pool_create(org=tworld.org, name="ci", machine_type=fake, target_size=0, max_size=2)
    member_ = ready_members(pool, 1, provider_ids="f-m")[0]
    busy = cli(admin, "pools", "delete", "ci")
    assert busy.returncode == 1 and "drain it first" in busy.stderr
    drained = ok(cli(admin, "pools", "drain", "ci", "--terminate-members"))
    assert drained.stdout.strip() == "pool ci drained: 1 member terminated"
    assert MachineInstance.objects.get(pk=member_.pk).status == "terminating"
    assert ok(cli(admin, "pools", "delete", "ci")).stdout.strip() == f"pool ci {str(pool.pk)[:8]} deleted"
    assert not InstancePool.objects.exists()

    job_config(tworld.org, tworld.machine_type, "old")
    assert ok(cli(admin, "configs", "delete", "old")).stdout.strip().startswith("job configuration old ")
    assert not JobConfiguration.objects.exists()

    idle = idle_machine(tworld.org, fake, provider_id="f-idle")
    listed = ok(cli(admin, "instances", "ls", "--status", "ready")).stdout
    assert str(idle.pk)[:8] in listed and str(member_.pk)[:8] not in listed
    shown = ok(cli(admin, "instances", "show", str(idle.pk)[:8])).stdout
    assert shown.startswith(f"instance {idle.pk}\n") and "status   ready" in shown
    ended = ok(cli(admin, "instances", "terminate", str(idle.pk)[:8])).stdout
    assert ended.strip() == f"instance {idle.pk} terminating"

    config = cli.tmp / "xdg" / "catacloud" / "config.toml"
    subprocess.run(
        [*CLI, "auth", "login", "--url", live_server.url], input=f"{admin}\n", env=cli.env(None), check=True,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    ok(cli(None, "auth", "status"))
    out = ok(cli(None, "auth", "logout"))
    assert out.stdout.strip() == f"logged out of {live_server.url}: profile 'default' removed from {config}"
    assert admin not in config.read_text()
    gone = cli(None, "jobs", "ls")
    assert gone.returncode == 2 and "no API token" in gone.stderr
    again = cli(None, "auth", "logout")
    assert again.returncode == 2 and f"no stored login for {live_server.url}" in again.stderr


# ---- with real agents ------------------------------------------------------------------------------


def test_follow_keeps_the_jobs_stderr_on_stderr(stack: Stack, cli: Cli) -> None:
    stack_job_config(stack, "noisy", "echo to-stdout; echo to-stderr >&2; echo again-stdout", reuse="reuse")
    result = ok(cli(stack.world.tokens["member"], "jobs", "submit", "--config", "noisy", "--follow"))
    assert result.stdout == "to-stdout\nagain-stdout\n"
    assert "to-stderr\n" in result.stderr and "succeeded" in result.stderr
