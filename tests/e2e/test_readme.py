"""README works as written: its walkthroughs run, as a reader would run them, against a real
stack (gunicorn, a Celery worker and beat, the local provider's agents, PostgreSQL, Redis).

Which blocks run is explicit in README: a ``<!-- readme-test: NAME -->`` line right above a
```` ```sh ```` fence. The host blocks (first-session, warm-pools, jobs) run one after the other
in one ``bash -e -o pipefail`` session, as one person's shell, with ``curl`` made strict
(``--fail-with-body``: an error answer fails the run); the in-job blocks (job-meta,
checkpoint) are submitted as job commands; the trace block runs in a folder laid out like the
clone. The only things the test provides are what README says ``make dev`` provides: the
demo catalog, ``$CATACLOUD_HOME/demo_token`` and ``.env``, ``PORT``. The cloud-only part (the
scratch database a real deployment points at an admin DSN) uses Catacloud's own server.
"""

from __future__ import annotations

import re
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DEMO_CATALOG = ROOT / "catacloud" / "data" / "demo.yaml"

MARKED = re.compile(
    r"^(?P<indent>[ \t]*)<!-- readme-test: (?P<name>[\w-]+)[^>]*-->\n"
    r"(?P=indent)```sh\n(?P<body>.*?)\n(?P=indent)```",
    re.S | re.M,
)
SH_BLOCK = re.compile(r"^[ \t]*```sh\n(?P<body>.*?)\n[ \t]*```", re.S | re.M)
EXPECTED = {"first-session", "warm-pools", "jobs", "job-meta", "checkpoint", "trace"}
FAST = {
    "CATACLOUD_HEARTBEAT_INTERVAL": "0.5",
    "CATACLOUD_AGENT_LOST_AFTER": "6",
    "CATACLOUD_AGENT_POLL_TIMEOUT": "5",
    "CATACLOUD_REAPER_INTERVAL": "2",
    "CATACLOUD_SCHEDULER_INTERVAL": "2",
    "CATACLOUD_RECONCILE_GRACE": "30",
}


def readme_blocks() -> dict[str, str]:
    text = README.read_text()
    return {m["name"]: textwrap.dedent(m["body"]) for m in MARKED.finditer(text)}


# ---- static checks (no stack) ----------------------------------------------------------------


def test_readme_marks_the_walkthrough_blocks_it_runs() -> None:
    assert set(readme_blocks()) == EXPECTED


def _unquoted_question_marks(line: str) -> list[str]:
    """Words holding a ``?`` outside quotes (zsh: "no matches found"); ``$?`` is fine."""
    found, word, quote = [], "", ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            break  # a comment
        elif ch == "?" and line[i - 1 : i] != "$":
            found.append(word + ch)
        word = "" if ch.isspace() else word + ch
    return found


def test_every_url_with_a_query_is_quoted_in_every_shell_block() -> None:
    bad = []
    for m in SH_BLOCK.finditer(README.read_text()):
        for line in m["body"].splitlines():
            if _unquoted_question_marks(line):
                bad.append(line.strip())
    assert not bad, "unquoted '?' (zsh globbing):\n" + "\n".join(bad)
    assert _unquoted_question_marks("curl $CC/instances/?status=ready")  # the check can fail


def test_the_checkpoint_example_fails_loudly_when_it_cannot_save(tmp_path: Path) -> None:
    """Without ``catacloud`` (or without an agent to save to) the job must fail, never go on
    and report success with nothing saved."""
    (tmp_path / "out").mkdir()
    (tmp_path / "ckpt").mkdir()
    env = {
        "PATH": "/usr/bin:/bin",  # no catacloud here
        "CATACLOUD_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "CATACLOUD_OUTPUT_DIR": str(tmp_path / "out"),
        "CATACLOUD_ATTEMPT": "1",
    }
    result = subprocess.run(
        ["/bin/sh", "-c", readme_blocks()["checkpoint"]], env=env, capture_output=True, text=True, timeout=30
    )
    assert result.returncode != 0
    assert not (tmp_path / "out" / "summary.txt").exists()


# ---- the stack ---------------------------------------------------------------------------------


def _logs(tmp: Path) -> str:
    """The stack's logs (web, worker, beat, agents): what a failure needs to be understood."""
    parts = []
    for path in sorted(tmp.glob("*.log")) + sorted((tmp / "machines").glob("*.log")):
        parts.append(f"---- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
    return "\n".join(parts)


def _run_shell(script: str, *, env: dict[str, str], cwd: Path, timeout: float, tmp: Path) -> tuple[str, str]:
    try:
        result = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", script],
            env=env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace")
        err = (exc.stderr or b"").decode(errors="replace")
        raise AssertionError(
            f"timed out\n--- stdout\n{out}\n--- stderr\n{err[-5000:]}\n{_logs(tmp)}"
        ) from None
    assert result.returncode == 0, (
        f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr[-5000:]}\n"
        + _logs(tmp)
    )
    return result.stdout, result.stderr


@pytest.fixture
def demo(transactional_db: None, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """What `make dev` sets up: the demo catalog (org demo, machine type local-small), the
    admin's token in $CATACLOUD_HOME/demo_token, .env naming the services; plus the resource
    types README's job-meta example holds."""
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    from apps.machines.models import ProviderAccount
    from apps.orgs.models import Organization
    from apps.orgs.services import api_token_create
    from testkit.processes import TESTS

    call_command("apply", str(DEMO_CATALOG), verbosity=0)
    resources = tmp_path / "resources.yaml"
    resources.write_text(
        textwrap.dedent(
            """\
            resource_types:
              - id: ci-token
                well: api_token
                max_instances: 5
              - id: scratch-db
                well: postgres_database
                config: {use_catacloud_database: true}
                max_instances: 5
            """
        )
    )
    call_command("apply", str(resources), verbosity=0)
    machines = tmp_path / "machines"
    account = ProviderAccount.objects.get(name="local")
    account.config = {**account.config, "state_dir": str(machines)}
    account.save()
    user = get_user_model().objects.get(username="admin")
    _, token = api_token_create(org=Organization.objects.get(slug="demo"), user=user)
    home = tmp_path / "home"
    home.mkdir()
    (home / "demo_token").write_text(token)
    env = TESTS.env()
    (home / ".env").write_text(
        "".join(f"{k}={env[k]}\n" for k in ("DATABASE_URL", "REDIS_URL", "CATACLOUD_EMBEDDED"))
    )
    try:
        yield {"token": token, "home": home, "tmp": tmp_path}
    finally:
        from catacloud.providers.local import LocalProvider

        provider = LocalProvider(config={"state_dir": str(machines)}, credentials={})
        for machine in provider.list({}):
            provider.delete(machine.provider_id)


@pytest.fixture
def stack(demo: dict[str, Any], tmp_path: Path) -> Iterator[dict[str, Any]]:
    from django.test import override_settings

    from testkit.processes import TESTS, purge_redis

    purge_redis()
    with (
        TESTS.gunicorn(tmp_path, workers=2, threads=16, **FAST) as (url, web),
        override_settings(**{k: float(v) for k, v in FAST.items()}, CATACLOUD_PUBLIC_URL=url),
        TESTS.celery_worker(tmp_path, concurrency=4, CATACLOUD_PUBLIC_URL=url, **FAST) as worker,
        TESTS.celery_beat(tmp_path, CATACLOUD_PUBLIC_URL=url, **FAST) as beat,
    ):
        try:
            yield {**demo, "url": url, "port": url.rsplit(":", 1)[1]}
        except BaseException:
            for proc in (web, worker, beat):
                print(f"---- {proc.name} log ----\n", proc.output()[-4000:])
            raise


def _shell_env(stack: dict[str, Any], bin_dir: Path) -> dict[str, str]:
    strict_curl = bin_dir / "curl"
    strict_curl.write_text('#!/bin/sh\nexec /usr/bin/curl --fail-with-body --max-time 30 "$@"\n')
    strict_curl.chmod(0o755)
    return {
        "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(stack["tmp"]),
        "LANG": "C.UTF-8",
        "PORT": stack["port"],
        "CATACLOUD_HOME": str(stack["home"]),
    }


def _wait_job(api: requests.Session, base: str, job_id: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = api.get(f"{base}/jobs/{job_id}/").json()
        if body["status"] in ("succeeded", "failed", "cancelled", "timed_out"):
            return body
        assert time.monotonic() < deadline, f"job {job_id} still {body['status']}"
        time.sleep(0.5)


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_readme_walkthroughs_run_as_written(stack: dict[str, Any], tmp_path: Path) -> None:
    from apps.events.models import Event
    from apps.jobs.models import Job

    blocks = readme_blocks()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = _shell_env(stack, bin_dir)
    clone = ROOT  # where README's reader stands: the clone's folder

    # 1. The host walkthroughs, in one shell session.
    session = "\n".join(["set -x", blocks["first-session"], blocks["warm-pools"], blocks["jobs"]])
    out, err = _run_shell(session, env=env, cwd=clone, timeout=240, tmp=tmp_path)
    assert "local-small" in out  # the machine types
    assert re.search(r'"ssh_user": null', out) and '"provider": "local"' in out  # acquire: access
    assert re.search(r"hello from \S+, shard 3", out), out  # /bin/sh: $(uname -n), the job's env
    codes = [line for line in out.splitlines() if re.fullmatch(r"\d{3}", line)]
    assert codes == ["202", "202", "204", "202"], codes  # release, terminate, delete, cancel
    pool_events = [line for line in out.splitlines() if line.startswith("pool.")]
    assert {"pool.created", "pool.member_claimed", "pool.updated", "pool.drained", "pool.deleted"} <= set(
        pool_events
    ), pool_events

    # 2. In-job blocks: README's job-meta and checkpoint examples as job commands.
    api = requests.Session()
    api.headers["Authorization"] = f"Bearer {stack['token']}"
    base = f"{stack['url']}/api/v1"
    mt = api.get(f"{base}/machine-types/").json()["results"][0]["id"]
    ran = {}
    for name, resources in (("job-meta", ["ci-token", "scratch-db"]), ("checkpoint", [])):
        config = api.post(
            f"{base}/job-configs/",
            json={
                "name": f"readme-{name}",
                "machine_type": mt,
                "command": blocks[name],
                "resources": resources,
                "timeout_seconds": 120,
                "max_attempts": 1,
            },
        )
        assert config.status_code == 201, config.text
        job = api.post(f"{base}/jobs/", json={"config": config.json()["id"]})
        assert job.status_code == 201, job.text
        ran[name] = job.json()["id"]
    for name, job_id in ran.items():
        body = _wait_job(api, base, job_id, 180)
        logs = api.get(f"{base}/jobs/{job_id}/logs/").json()["text"]
        assert body["status"] == "succeeded" and body["exit_code"] == 0, (name, body, logs)
        ran[name] = logs
    meta_job = Job.objects.get(config__name="readme-job-meta")
    assert f'"id":"{meta_job.pk}"' in ran["job-meta"].replace(" ", ""), ran["job-meta"]  # the token worked
    checkpoint_job = Job.objects.get(config__name="readme-checkpoint")
    assert ran["checkpoint"].count("checkpoint saved") == 5, ran["checkpoint"]
    summary = api.get(f"{base}/jobs/{checkpoint_job.pk}/artifacts/summary.txt")
    assert summary.status_code == 200 and summary.text.startswith("finished at step 5 (attempt 1)")

    # 3. The trace block: the venv, the services' .env, the demo org's finished jobs.
    trace = clone / "demo.csv"
    try:
        out, _ = _run_shell(blocks["trace"], env=env, cwd=clone, timeout=180, tmp=tmp_path)
        rows = trace.read_text().splitlines()
    finally:
        trace.unlink(missing_ok=True)
    assert rows[0] == "submit_time_seconds,duration_seconds,config" and len(rows) >= 3, rows
    assert "ephemeral" in out and "pool:5" in out

    # 4. Every event kind this run wrote is one README names.
    text = README.read_text()
    unnamed = sorted(
        {k for k in Event.objects.values_list("kind", flat=True).distinct() if f"`{k}`" not in text}
    )
    assert not unnamed, f"event kinds README does not name: {unnamed}"
