"""README and the documentation work as written: their walkthroughs run, as a reader pastes them,
in reading order (README's first session, then the pages of docs/ in the order of mkdocs.yml's
navigation), in one shell session, against a real stack (gunicorn, a Celery worker and beat,
the local provider's agents, PostgreSQL, Redis).

Every ```` ```sh ```` block in README and in docs/ carries a marker on the line right above it: either
``<!-- readme-test: NAME -->`` (it runs) or ``<!-- readme-skip: REASON -->`` (it does not, and
says why), so a new block cannot go untested by accident. The blocks that run do so one after
the other in one ``bash -e -o pipefail`` session, as one person's shell, from the clone's
folder, with ``curl`` made strict (``--fail-with-body``: an error answer fails the run); the
blocks that are a job's command (job-meta, checkpoint) are submitted as jobs where they stand
and waited for. The only things the test provides are what README says ``make dev`` provides:
the demo catalog, ``$CATACLOUD_HOME/demo_token`` and ``.env``, ``PORT``; and, for the images
walkthrough, a registry on loopback (``REGISTRY``, Debian's docker-registry, as the test kit runs
PostgreSQL and Redis), which that page tells its reader how to start. The cloud-only part
(the scratch database a real deployment points at an admin DSN) uses Catacloud's own server.
"""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# Where README's event kinds and error codes live (tests/core/test_registries.py reads it too).
EVENTS_PAGE = ROOT / "docs" / "architecture" / "events-and-errors.md"
DEMO_CATALOG = ROOT / "catacloud" / "data" / "demo.yaml"

SH_BLOCK = re.compile(r"^(?P<indent>[ \t]*)```sh\n(?P<body>.*?)\n(?P=indent)```", re.S | re.M)
MARK = re.compile(r"^[ \t]*<!-- readme-(?P<what>test|skip): (?P<name>[\w-]+)?[^>]*-->$")
# The blocks that run, in README order; those that are a job's command, with the resource
# types the job holds.
EXPECTED = [
    "first-session",
    "warm-pools",
    "jobs",
    "cli",
    "costs",
    "budgets",
    "job-meta",
    "artifacts",
    "checkpoint",
    "trace",
    "images",
]
IN_JOB = {"job-meta": ["ci-token", "scratch-db"], "checkpoint": []}
WRITES = ("demo.csv", "costs.csv", "shard.txt")  # files the walkthroughs leave in the clone's folder
FAST = {
    "CATACLOUD_HEARTBEAT_INTERVAL": "0.5",
    "CATACLOUD_AGENT_LOST_AFTER": "6",
    "CATACLOUD_AGENT_POLL_TIMEOUT": "5",
    "CATACLOUD_REAPER_INTERVAL": "2",
    "CATACLOUD_SCHEDULER_INTERVAL": "2",
    "CATACLOUD_RECONCILE_GRACE": "30",
}


def marked_blocks(text: str) -> list[tuple[str, str, str]]:
    """Every sh block of ``text`` in order, as (``test`` | ``skip`` | ``unmarked``, name or
    reason, body)."""
    blocks = []
    for m in SH_BLOCK.finditer(text):
        above = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.match(above)
        what = mark["what"] if mark else "unmarked"
        name = (mark["name"] or "") if mark else above.strip()
        blocks.append((what, name, textwrap.dedent(m["body"])))
    return blocks


def reading_order() -> list[Path]:
    """README, then every page of the documentation in the order of its navigation (mkdocs.yml)."""

    def pages(node: Any) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [page for item in node for page in pages(item)]
        if isinstance(node, dict):
            return [page for value in node.values() for page in pages(value)]
        return []

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    return [README, *(ROOT / "docs" / page for page in pages(nav))]


def all_blocks() -> list[tuple[str, str, str]]:
    """Every sh block of README and the documentation, in reading order."""
    return [block for path in reading_order() for block in marked_blocks(path.read_text())]


def readme_blocks() -> dict[str, str]:
    return {name: body for what, name, body in all_blocks() if what == "test"}


# ---- static checks (no stack) ----------------------------------------------------------------


def test_every_page_is_read_in_order() -> None:
    order = reading_order()
    assert order[0] == README and len(order) > 10
    assert all(path.exists() for path in order)
    # every page of docs/ has its place in the reading order (mkdocs --strict says so too)
    assert set((ROOT / "docs").rglob("*.md")) == set(order[1:])


def test_every_sh_block_is_run_or_says_why_not() -> None:
    blocks = all_blocks()
    unmarked = [body.splitlines()[0] for what, _, body in blocks if what == "unmarked"]
    assert not unmarked, f"sh blocks with no readme-test / readme-skip marker: {unmarked}"
    assert [name for what, name, _ in blocks if what == "test"] == EXPECTED
    assert all(name for what, name, _ in blocks if what == "skip")  # a reason each
    # the check can fail
    assert marked_blocks("text\n```sh\necho hi\n```\n")[0][0] == "unmarked"


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
    for m in (m for path in reading_order() for m in SH_BLOCK.finditer(path.read_text())):
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


def _as_job(name: str, command: str) -> str:
    """Shell that runs a block which is a job's command as README's reader would: a
    configuration with it as the command (holding the resource types the block uses), one job,
    waited for until it ends; then a ``readme-job NAME ID`` line for the checks."""
    config = {"name": f"readme-{name}", "machine_type": "local-small", "resources": IN_JOB[name]}
    config |= {"timeout_seconds": 120, "max_attempts": 1}
    api = 'curl -s -H "Authorization: Bearer $TOKEN" -H "Content-Type: application/json"'
    return "\n".join(
        [
            "RT_CMD=$(cat <<'RT_BLOCK_END'",
            command.rstrip("\n"),
            "RT_BLOCK_END",
            ")",
            f"RT_CFG=$(jq -n --arg cmd \"$RT_CMD\" '{json.dumps(config)} + {{command: $cmd}}' |",
            f'  {api} -X POST "$CC/job-configs/" -d @- | jq -r .id)',
            "RT_JOB=$(jq -n --arg cfg \"$RT_CFG\" '{config: $cfg}' |",
            f'  {api} -X POST "$CC/jobs/" -d @- | jq -r .id)',
            f'until {api} "$CC/jobs/$RT_JOB/" | jq -e ".finished_at != null" >/dev/null; do sleep 1; done',
            f'echo "readme-job {name} $RT_JOB"',
        ]
    )


@pytest.mark.e2e
@pytest.mark.timeout(1000)
def test_readme_walkthroughs_run_in_order_as_pasted(stack: dict[str, Any], tmp_path: Path) -> None:
    from apps.events.models import Event
    from apps.machines.models import Budget
    from testkit.registry import Registry

    blocks = readme_blocks()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = _shell_env(stack, bin_dir)
    clone = ROOT  # where README's reader stands: the clone's folder (its .venv, manage.py)

    # Every block that runs, in README order, in one shell session.
    session = "\n".join(
        ["set -x", *(_as_job(name, blocks[name]) if name in IN_JOB else blocks[name] for name in EXPECTED)]
    )
    try:
        with Registry(tmp_path / "registry") as registry:  # the images walkthrough's
            env["REGISTRY"] = registry.host
            out, err = _run_shell(session, env=env, cwd=clone, timeout=840, tmp=tmp_path)
        written = {name: (clone / name).read_text() for name in WRITES if (clone / name).exists()}
    finally:
        for name in WRITES:
            (clone / name).unlink(missing_ok=True)

    # first session, warm pools, jobs
    assert "local-small" in out  # the machine types
    assert re.search(r'"ssh_user": null', out) and '"provider": "local"' in out  # acquire: access
    assert re.search(r"hello from \S+, shard 3", out), out  # /bin/sh: $(uname -n), the job's env
    codes = [line for line in out.splitlines() if re.fullmatch(r"\d{3}", line)]
    assert codes == ["202", "202", "204", "202"], codes  # release, terminate, delete, cancel
    pool_events = [line for line in out.splitlines() if line.startswith("pool.")]
    assert {"pool.created", "pool.member_claimed", "pool.updated", "pool.drained", "pool.deleted"} <= set(
        pool_events
    ), pool_events

    # the command line client: after the warm-pools walkthrough deleted its pool `ci`
    assert re.search(r"^logged in to http://127\.0\.0\.1:\d+: token checked", out, re.M), out
    assert "\nevents:\n" in out and "job.finished" in out  # jobs show
    assert re.search(r"^ci +[0-9a-f]{8} +\w+ +local-small ", out, re.M), out  # pools ls: the type by name
    assert "job configuration lint " in out and "instance " in out and " released " in out

    # costs and budgets
    costs = written["costs.csv"]
    assert costs.startswith("start,end,seconds,kind,amount,currency,"), costs[:200]
    assert Budget.objects.filter(machine_type__name="local-small", period="day").exists()
    assert '"machine_type": "local-small"' in out

    # job outputs: the CLI's --wait job wrote shard.txt
    assert written["shard.txt"].startswith("shard"), written

    # the blocks that are a job's command, run as jobs
    api = requests.Session()
    api.headers["Authorization"] = f"Bearer {stack['token']}"
    base = f"{stack['url']}/api/v1"
    ran = dict(re.findall(r"^readme-job ([\w-]+) (\S+)$", out, re.M))
    assert set(ran) == set(IN_JOB), out
    logs = {}
    for name, job_id in ran.items():
        body = api.get(f"{base}/jobs/{job_id}/").json()
        logs[name] = api.get(f"{base}/jobs/{job_id}/logs/").json()["text"]
        assert body["status"] == "succeeded" and body["exit_code"] == 0, (name, body, logs[name])
    assert f'"id":"{ran["job-meta"]}"' in logs["job-meta"].replace(" ", ""), logs[
        "job-meta"
    ]  # the token worked
    assert logs["checkpoint"].count("checkpoint saved") == 5, logs["checkpoint"]
    summary = api.get(f"{base}/jobs/{ran['checkpoint']}/artifacts/summary.txt")
    assert summary.status_code == 200 and summary.text.startswith("finished at step 5 (attempt 1)")

    # the trace: the venv, the services' .env, the demo org's finished jobs
    rows = written["demo.csv"].splitlines()
    assert rows[0] == "submit_time_seconds,duration_seconds,config" and len(rows) >= 3, rows
    assert "ephemeral" in out and "pool:5" in out

    # images: a job ran inside the image, its digest recorded; the next did not pull; a bad
    # reference was refused; the password never came back; the pool's member held the image
    assert "ID=hello-image" in out and re.search(r'"image_digest": "sha256:[0-9a-f]{64}"', out), out
    assert "job.image_cached" in out and "hi from the image" in out
    assert '"code":"invalid_image_reference"' in out and "not-shown-again" not in out
    assert re.search(r'\{"status":"ready","images":\[[^]]*demo/hello:1', out), out

    # Every event kind this run wrote is one the documentation names.
    text = EVENTS_PAGE.read_text()
    unnamed = sorted(
        {k for k in Event.objects.values_list("kind", flat=True).distinct() if f"`{k}`" not in text}
    )
    assert not unnamed, f"event kinds the documentation does not name: {unnamed}"
