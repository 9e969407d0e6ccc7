"""README and the documentation work as written: their walkthroughs run, as a reader pastes them, in
reading order (README's first session, then the pages of docs/ in the order of mkdocs.yml's
navigation), in one shell session, against a real stack (gunicorn, a Celery worker and beat, the
local provider's agents, PostgreSQL, Redis).

Every ```` ```sh ```` block in README and in docs/ carries a marker on the line right above it:
either ``<!-- readme-test: NAME -->`` (it runs) or ``<!-- readme-skip: REASON -->`` (it does not,
and says why), so a new block cannot go untested by accident. The blocks that run do so one after
the other in one ``bash -e -o pipefail`` session, as one person's shell, from the clone's folder,
with ``curl`` made strict (``--fail-with-body``: an error answer fails the run). A job's command
is never pasted into the reader's shell: a block submits it as a job (a heredoc in a variable, the
configuration's ``command``). The only things the test provides are what README says
``CATACLOUD_DEV_GITHUB=fake CATACLOUD_DEV_GITLAB=fake CATACLOUD_DEV_CLOUD=fake make dev``
provides: the demo catalog (its scratch database on Catacloud's own server),
``$CATACLOUD_HOME/demo_token`` and ``.env``, ``PORT``, the fake GitHub on ``GITHUB_FAKE_PORT`` and
the fake GitLab on ``GITLAB_FAKE_PORT`` with the demo org connected to them, and the fake Hetzner
Cloud API on ``HETZNER_FAKE_PORT`` that organizations' own Hetzner accounts call. The images
walkthrough starts its own registry (Debian's docker-registry on a free loopback port, in a folder
of its own) and stops it at its end, as its reader does; the hosts walkthrough starts two
``catacloud host`` processes on this machine, each with a folder of its own, and revokes them at
its end (they end their slots and exit). The walkthroughs leave no file in the clone and no
process behind, and every wait in them has a time limit.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# Where README's event kinds and error codes live (tests/core/test_registries.py reads it too).
EVENTS_PAGE = ROOT / "docs" / "architecture" / "events-and-errors.md"
DEMO_CATALOG = ROOT / "catacloud" / "data" / "demo.yaml"

SH_BLOCK = re.compile(r"^(?P<indent>[ \t]*)```sh\n(?P<body>.*?)\n(?P=indent)```", re.S | re.M)
MARK = re.compile(r"^[ \t]*<!-- readme-(?P<what>test|skip): (?P<name>[\w-]+)?[^>]*-->$")
# The blocks that run, in reading order.
EXPECTED = [
    "first-session",
    "warm-pools",
    "jobs",
    "cli",
    "github-connect",
    "github-class",
    "github-run",
    "gitlab-connect",
    "gitlab-class",
    "gitlab-run",
    "costs",
    "budgets",
    "resource-types",
    "job-meta",
    "artifacts",
    "checkpoint",
    "trace",
    "registry",
    "images",
    "containers",
    "hosts",
    "hosts-drain",
    "selection",
    "own-cloud",
]
# A job's command in a block: ``NAME=$(cat <<'EOF' … EOF`` (submitted by the block, never run by it).
HEREDOC = re.compile(r"<<'(?P<tag>\w+)'\n(?P<body>.*?)\n(?P=tag)\n", re.S)
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


def job_command(block: str) -> str:
    """The job's command a block submits (its heredoc)."""
    m = HEREDOC.search(block)
    assert m, block
    return m["body"]


def in_the_shell(block: str) -> str:
    """What of a block runs in the reader's shell: all but its jobs' commands."""
    return HEREDOC.sub("<<'JOB'\n", block)


# ---- static checks (no stack) ----------------------------------------------------------------


def test_every_page_is_read_in_order() -> None:
    order = reading_order()
    assert order[0] == README and len(order) > 10
    assert all(path.exists() for path in order)
    # every page of docs/ has its place in the reading order (mkdocs --strict says so too)
    assert set((ROOT / "docs").rglob("*.md")) == set(order[1:])


def test_the_documentation_index_links_every_page_of_the_navigation() -> None:
    """docs/index.md, the site's front page, listed every page but the operations guide."""
    index = (ROOT / "docs" / "index.md").read_text()
    linked = {(ROOT / "docs" / target).resolve() for target in re.findall(r"\]\(([\w/.-]+\.md)\)", index)}
    missing = [str(page.relative_to(ROOT)) for page in reading_order()[2:] if page.resolve() not in linked]
    assert not missing, f"docs/index.md does not link: {missing}"


def test_every_sh_block_is_run_or_says_why_not() -> None:
    blocks = all_blocks()
    unmarked = [body.splitlines()[0] for what, _, body in blocks if what == "unmarked"]
    assert not unmarked, f"sh blocks with no readme-test / readme-skip marker: {unmarked}"
    assert [name for what, name, _ in blocks if what == "test"] == EXPECTED
    assert all(name for what, name, _ in blocks if what == "skip")  # a reason each
    # the check can fail
    assert marked_blocks("text\n```sh\necho hi\n```\n")[0][0] == "unmarked"


FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```|~~~)", re.M)


def indented_fences(text: str) -> list[str]:
    """The opening lines of fenced blocks that are indented (a block inside a list item)."""
    lines = text.splitlines()
    found, inside = [], False
    for m in FENCE.finditer(text):
        if not inside and m["indent"]:
            found.append(lines[text.count("\n", 0, m.start())].strip())
        inside = not inside
    return found


def test_every_block_pastes_as_it_stands_in_the_raw_markdown() -> None:
    """A block inside a list item is indented in the Markdown: pasted from the raw page (GitHub's
    source view, an editor), every line keeps the indentation, and a heredoc's closing ``EOF``
    with spaces before it never closes it (the checkpoint block left the reader's shell waiting
    at a ``>`` prompt). The test's own dedent hid it. Blocks stand at the margin, between list
    items."""
    bad = [
        f"{path.relative_to(ROOT)}: {line}"
        for path in reading_order()
        for line in indented_fences(path.read_text())
    ]
    assert not bad, "indented fenced blocks:\n" + "\n".join(bad)
    # the check can fail
    assert indented_fences("- an item:\n\n  ```sh\n  echo hi\n  ```\n") == ["```sh"]
    assert indented_fences("- an item\n\n```sh\necho hi\n```\n") == []


def _shell_of(page: Path) -> str:
    return "\n".join(
        in_the_shell(body) for what, _, body in marked_blocks(page.read_text()) if what == "test"
    )


def test_the_images_page_runs_its_registry_on_a_free_port_in_a_folder_of_its_own_and_stops_it() -> None:
    """The page started its registry on port 5000 in /tmp/cc-registry (a second reader, or one
    with anything on 5000, failed; the folder outlived the session) and never stopped it; the
    walkthrough test started a registry of its own instead of the page's."""
    shell = _shell_of(ROOT / "docs" / "walkthroughs" / "images.md")
    assert "docker-registry serve" in shell  # the page's own registry, run by the walkthrough test
    assert not re.search(r"127\.0\.0\.1:\d|:5000\b", shell), "a fixed port"
    assert not re.search(r"(?<![\w$])/tmp/", shell), "a fixed folder"
    assert "$(mktemp -d)" in shell
    started = shell.index("docker-registry serve")
    stopped = shell.index('kill "$REGISTRY_PID"')
    assert started < shell.rindex("$REGISTRY/") < stopped  # stopped after its last use
    assert 'rm -rf "$REGISTRY_DIR"' in shell[stopped:]


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


def test_the_walkthroughs_never_hang_exit_or_run_job_commands_in_the_readers_shell() -> None:
    """A wait without a time limit hung the reader's shell (and the test) when what it waited for
    never came; ``set -e`` pasted into an interactive shell closed it at the first error; job-side
    commands pasted into it (``job-meta``, ``checkpoint``) failed and overwrote ``$TOKEN``; a
    hard-coded month worked for one month."""
    bad = []
    for name, body in readme_blocks().items():
        shell = in_the_shell(body)
        for line in shell.splitlines():
            code = "" if line.lstrip().startswith("#") else line.split(" #", 1)[0]
            if re.match(r"\s*(until|while)\b", code):
                bad.append(f"{name}: a wait with no time limit (use: for i in $(seq N); do …): {line}")
            if re.search(r"\bset -e\b", code):
                bad.append(f"{name}: set -e closes an interactive shell: {line}")
            if re.search(r"\bcatacloud (job-meta|checkpoint)\b", code):
                bad.append(f"{name}: a job-side command in the reader's shell: {line}")
            if re.search(r"\b20\d\d-\d\d-\d\d\b", code):
                bad.append(f"{name}: a hard-coded date: {line}")
    assert not bad, "\n".join(bad)
    # the checks can fail
    assert re.match(r"\s*(until|while)\b", in_the_shell("until false; do sleep 1; done"))
    assert "job-meta" not in in_the_shell("X=$(cat <<'EOF'\ncatacloud job-meta a\nEOF\n)\n")


ASSIGNED = re.compile(r"(?:^|[\s;(&|])(?:export\s+)?(?P<name>[A-Z][A-Z0-9_]*)=")
READ = re.compile(r"\$\{?(?P<name>[A-Z][A-Z0-9_]*)")


def test_a_variable_one_page_leaves_for_another_is_set_by_one_page_only() -> None:
    """The GitHub page set ``JOB`` to GitHub's id of a workflow job, so the costs page, which
    meant the command line client's job, read a 404 (``null``)."""
    pages = [
        (path, [body for what, _, body in marked_blocks(path.read_text()) if what == "test"])
        for path in reading_order()
    ]
    setters: dict[str, set[str]] = {}
    bad = []
    for path, bodies in pages:
        shell = "\n".join(in_the_shell(body) for body in bodies)
        assigned_here = {m["name"] for m in ASSIGNED.finditer(shell)}
        for m in READ.finditer(shell):
            name = m["name"]
            first_set = next((a.start() for a in ASSIGNED.finditer(shell) if a["name"] == name), None)
            inherited = first_set is None or first_set > m.start()
            if inherited and len(setters.get(name, set())) > 1:
                bad.append(f"{path.name} reads ${name}, which {sorted(setters[name])} all set")
        for name in assigned_here:
            setters.setdefault(name, set()).add(path.name)
    assert not bad, "\n".join(sorted(set(bad)))


def test_what_make_dev_prints_points_at_pages_that_exist() -> None:
    """Its banner sent readers to a README section that had moved to docs/."""
    source = (ROOT / "catacloud" / "cli.py").read_text()
    named = set(re.findall(r"docs/[\w/.-]+\.md", source))
    assert "docs/walkthroughs/github-actions.md" in named
    assert all((ROOT / page).exists() for page in named), named
    assert "README: " not in source


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
        ["/bin/sh", "-c", job_command(readme_blocks()["checkpoint"])],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode != 0
    assert not (tmp_path / "out" / "summary.txt").exists()


def test_the_checkpoint_example_resumes_where_its_lost_attempt_stopped(tmp_path: Path) -> None:
    """The page's job checkpointed and finished in its first attempt: it never showed a resume.
    Here its machine goes away during the first attempt's long step (the shell is killed), and
    the second attempt, with the checkpoint folder restored, goes on from step 3."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tools = {
        "catacloud": '#!/bin/sh\n[ "$1" = checkpoint ] && echo "checkpoint saved"\n',
        # a long step: the machine goes away under it, and the job's shell with it
        "sleep": '#!/bin/sh\n[ "$1" -lt 60 ] || kill -9 "$PPID"\n',
    }
    for name, text in tools.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "ckpt").mkdir()
    command = job_command(readme_blocks()["checkpoint"])

    def attempt(n: int) -> subprocess.CompletedProcess[str]:
        out = tmp_path / f"out-{n}"
        out.mkdir()
        env = {
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "CATACLOUD_CHECKPOINT_DIR": str(tmp_path / "ckpt"),  # restored as the last one left it
            "CATACLOUD_OUTPUT_DIR": str(out),
            "CATACLOUD_ATTEMPT": str(n),
        }
        return subprocess.run(["/bin/sh", "-c", command], env=env, capture_output=True, text=True, timeout=30)

    first = attempt(1)
    assert first.returncode != 0 and "attempt 1 starts at step 0" in first.stdout, first
    assert first.stdout.count("checkpoint saved") == 3 and not (tmp_path / "out-1" / "summary.txt").exists()
    second = attempt(2)
    assert second.returncode == 0 and "attempt 2 starts at step 3" in second.stdout, second
    assert second.stdout.count("checkpoint saved") == 2
    assert (tmp_path / "out-2" / "summary.txt").read_text() == "finished at step 5 (attempt 2)\n"


# ---- the stack ---------------------------------------------------------------------------------


def _logs(tmp: Path) -> str:
    """The stack's logs (web, worker, beat, agents) and the output of every failed job's attempt:
    what a failure needs to be understood."""
    from apps.jobs.choices import JobStatus
    from apps.jobs.models import Job, JobLogChunk

    parts = []
    for path in sorted(tmp.glob("*.log")) + sorted((tmp / "machines").glob("*.log")):
        parts.append(f"---- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
    for job in Job.objects.filter(status=JobStatus.FAILED).order_by("created_at"):
        chunks = JobLogChunk.objects.filter(job=job, attempt=job.attempt).order_by("seq")
        output = "".join(f"[{c.stream}] {c.data}" for c in chunks)
        head = f"---- failed job {job.pk} attempt {job.attempt}: {job.failure_reason}"
        parts.append(f"{head}\n{output[-3000:]}")
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
    """What `make dev` sets up: the demo catalog (org demo, machine type local-small, resource
    types ci-token and scratch-db), the admin's token in $CATACLOUD_HOME/demo_token, .env naming
    the services."""
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    from apps.orgs.models import Organization
    from apps.orgs.services import api_token_create
    from testkit.processes import TESTS

    call_command("apply", str(DEMO_CATALOG), verbosity=0)
    machines = tmp_path / "machines"
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
        yield {"token": token, "home": home, "tmp": tmp_path, "machines": machines}
    finally:
        from catacloud.providers.local import LocalProvider

        provider = LocalProvider(config={"state_dir": str(machines)}, credentials={})
        # Every machine with a record, not only those list() shows: one whose agent already
        # exited (told to stop while its termination raced its provisioning) is "gone" to the
        # control plane but still holds its folder and its jobs' mounted file system here.
        for record in sorted(machines.glob("*.json")):
            provider.delete(record.stem)


def _local_machines_in(folder: Path) -> None:
    from apps.machines.models import ProviderAccount

    account = ProviderAccount.objects.get(name="local")
    account.config = {**account.config, "state_dir": str(folder)}
    account.save()


@pytest.fixture
def fake_github(demo: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """What ``CATACLOUD_DEV_GITHUB=fake`` adds to ``make dev``: its fake GitHub (here a thread of
    this process, with the key and secret ``make dev`` keeps in $CATACLOUD_HOME), the demo org
    connected to it, the stand-in runner in the local machines, the fake's port in the local
    machine type's ``network.allow`` (``catacloud.cli.DevGitHub``'s catalog, applied as is)."""
    from django.core.management import call_command

    from catacloud.cli import DevGitHub
    from testkit.github_fake import FakeGitHub
    from testkit.processes import free_port

    monkeypatch.setenv("GITHUB_FAKE_PORT", str(free_port()))
    # the web's port is not known yet: the fake learns where to deliver from the stack
    dev = DevGitHub.prepare(demo["home"], 0)
    call_command("apply", str(dev.catalog), verbosity=0)
    _local_machines_in(demo["machines"])
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(
        (demo["home"] / "github-fake-app.pem").read_bytes(), password=None
    )
    fake = FakeGitHub(
        app_id=1,
        public_key=key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
        webhook_secret=(demo["home"] / "github-fake-webhook-secret").read_text().strip(),
        port=int(dev.url.rsplit(":", 1)[1]),
    )
    fake.add_installation(1, "demo-org", ["demo-org/app"])
    try:
        yield fake
    finally:
        fake.stop()


@pytest.fixture
def fake_gitlab(demo: dict[str, Any], fake_github: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """What ``CATACLOUD_DEV_GITLAB=fake`` adds to ``make dev`` (after the fake GitHub): its fake
    GitLab (here a thread of this process, with the tokens ``make dev`` keeps in
    $CATACLOUD_HOME) and its project, the demo org connected to it, the stand-in gitlab-runner in
    the local machines, the fake's port in the local machine type's ``network.allow``
    (``catacloud.cli.DevGitLab``'s catalog, applied as is)."""
    from django.core.management import call_command

    from catacloud.cli import DevGitLab
    from testkit.gitlab_fake import FakeGitLab
    from testkit.processes import free_port

    monkeypatch.setenv("GITLAB_FAKE_PORT", str(free_port()))
    monkeypatch.setenv("GITHUB_FAKE_PORT", str(fake_github.port))
    monkeypatch.setenv("CATACLOUD_DEV_GITHUB", "fake")
    dev = DevGitLab.prepare(demo["home"], 0)
    call_command("apply", str(dev.catalog), verbosity=0)
    _local_machines_in(demo["machines"])
    fake = FakeGitLab(
        token=(demo["home"] / "gitlab-fake-token").read_text().strip(),
        webhook_token=(demo["home"] / "gitlab-fake-webhook-token").read_text().strip(),
        port=int(dev.url.rsplit(":", 1)[1]),
    )
    fake.add_project(1, "demo-group/app")
    try:
        yield fake
    finally:
        fake.stop()


@pytest.fixture
def fake_cloud(demo: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """What ``CATACLOUD_DEV_CLOUD=fake`` adds to ``make dev``: its fake Hetzner Cloud API (here a
    thread of this process, with the token ``make dev`` keeps in $CATACLOUD_HOME) and the
    operator's setting that sends organizations' own Hetzner accounts there
    (``catacloud.cli.DevCloud``'s settings, given to the stack's programs as is)."""
    from catacloud.cli import DevCloud
    from testkit.processes import free_port
    from tests.fakes.hetzner_api import FakeHetzner

    port = free_port()
    monkeypatch.setenv("HETZNER_FAKE_PORT", str(port))
    dev = DevCloud.prepare(demo["home"], 0)
    fake = FakeHetzner(token=(demo["home"] / "hetzner-fake-token").read_text().strip(), port=port).start()
    try:
        yield dev, fake
    finally:
        fake.stop()


@pytest.fixture
def stack(
    demo: dict[str, Any], fake_github: Any, fake_gitlab: Any, fake_cloud: Any, tmp_path: Path
) -> Iterator[dict[str, Any]]:
    from django.test import override_settings

    from testkit import gitlab_kit
    from testkit.github_kit import WEBHOOK_PATH
    from testkit.processes import TESTS, purge_redis

    purge_redis()
    cloud, hetzner = fake_cloud
    programs = {**FAST, **cloud.env}
    with (
        TESTS.gunicorn(tmp_path, workers=2, threads=16, **programs) as (url, web),
        override_settings(
            **{k: float(v) for k, v in FAST.items()},
            CATACLOUD_PUBLIC_URL=url,
            CATACLOUD_ORG_PROVIDER_SETTINGS=json.loads(cloud.env["CATACLOUD_ORG_PROVIDER_SETTINGS"]),
        ),
        TESTS.celery_worker(tmp_path, concurrency=4, CATACLOUD_PUBLIC_URL=url, **programs) as worker,
        TESTS.celery_beat(tmp_path, CATACLOUD_PUBLIC_URL=url, **programs) as beat,
    ):
        fake_github.webhook_url = url + WEBHOOK_PATH
        fake_github.start()
        fake_gitlab.webhook_url = url + gitlab_kit.WEBHOOK_PATH
        fake_gitlab.start()
        try:
            yield {
                **demo,
                "url": url,
                "port": url.rsplit(":", 1)[1],
                "github": fake_github,
                "gitlab": fake_gitlab,
                "hetzner": hetzner,
            }
        except BaseException:
            for proc in (web, worker, beat):
                print(f"---- {proc.name} log ----\n", proc.output()[-4000:])
            raise
        # Ended at once, as tests/e2e/conftest.py's stack ends its worker and beat: nothing of them
        # is asserted after the walkthroughs, the machines are stopped after them (``demo``), and
        # `make dev`'s own stop is tested on its own (tests/cli/test_dev_stop.py). Their graceful
        # stops, one after the other, took 16.5 s here (gunicorn 9.2 s, waiting on requests in hand).
        for proc in (beat, worker, web):
            proc.kill()


def _shell_env(stack: dict[str, Any], bin_dir: Path) -> dict[str, str]:
    strict_curl = bin_dir / "curl"
    strict_curl.write_text('#!/bin/sh\nexec /usr/bin/curl --fail-with-body --max-time 30 "$@"\n')
    strict_curl.chmod(0o755)
    return {
        "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(stack["tmp"]),
        "LANG": "C.UTF-8",
        "PORT": stack["port"],
        "GITHUB_FAKE_PORT": str(stack["github"].port),
        "GITLAB_FAKE_PORT": str(stack["gitlab"].port),
        "HETZNER_FAKE_PORT": str(stack["hetzner"].port),
        "CATACLOUD_HOME": str(stack["home"]),
    }


def _stop_hosts(home: str) -> list[str]:
    """End the ``catacloud host`` processes the walkthrough started (found by the session's
    CATACLOUD_HOME) and their slots, if a failure left them; returns what it found."""
    import psutil

    from testkit.processes import stop_local_machines

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "host" not in cmdline or "--slots-dir" not in cmdline:
            continue
        try:
            if proc.environ().get("CATACLOUD_HOME") != home:
                continue
            found.append(" ".join(cmdline))
            proc.kill()
            proc.wait(10)
        except (psutil.Error, OSError):
            continue
        stop_local_machines(cmdline[cmdline.index("--slots-dir") + 1], stop_timeout=1, ignore_errors=True)
    return found


def _check_hosts_walkthrough(out: str, err: str) -> None:
    from apps.jobs.models import Job
    from apps.machines.models import Host

    assert len(re.findall(r"^\S+ +[0-9a-f]{8} +active +demo +0/2 ", out, re.M)) == 2, out  # hosts ls
    assert re.search(r"^attempt 1 in slot cc-", out, re.M), out
    assert '{"provider":"hosts","machine_type":"on-my-hosts"' in out, out
    assert re.search(r"^attempt 2 done$", out, re.M) and out.count('{"status":"revoked"}') == 2, out
    hosts = list(Host.objects.filter(provider_account__name="my-hosts"))
    assert len(hosts) == 2 and {h.status for h in hosts} == {"revoked"}
    assert {h.labels.get("site") for h in hosts} == {"lab"}
    jobs = Job.objects.filter(config__name="on-my-hosts")
    assert [j.status for j in jobs] == ["succeeded"] * 4
    assert len({j.instance.host_id for j in jobs if j.instance}) == 2  # both hosts ran slots
    long = Job.objects.get(config__name="long-on-my-hosts")
    assert (long.status, long.attempt) == ("succeeded", 2), (long.status, long.attempt)
    host_a = re.search(r"^\+ HOST_A=(\S+)$", err, re.M)
    assert host_a and long.instance and str(long.instance.host_id) == host_a[1]  # the host taken back
    folder = re.search(r"^\+ HOSTS_DIR=(\S+)$", err, re.M)
    assert folder and not Path(folder[1]).exists(), "the hosts' folder is left"


def _check_own_cloud_walkthrough(out: str, hetzner: Any) -> None:
    """The wrong token refused with Hetzner's words, nothing of it stored; the right one stored
    and never shown; the org's machine bought in its own (fake) project and deleted there."""
    from apps.machines.models import MachineInstance, ProviderAccount

    assert '{"code":"provider_check_failed","detail":"the provider refused' in out, out
    assert "unable to authenticate" in out
    assert (
        '{"name":"our-hetzner","kind":"hetzner","config":{"location":"fsn1"},"credential_keys":["token"]}'
        in out
    )
    assert '{"name":"our-cx23","own":true,"provider_account":"our-hetzner","quota":2}' in out, out
    (account,) = ProviderAccount.objects.filter(org__slug="demo")
    assert account.credentials["token"] not in out
    (machine,) = MachineInstance.objects.filter(machine_type__name="our-cx23")
    assert machine.provider_account_id == account.pk and '"provider":"hetzner"' in out
    assert machine.status in ("terminating", "terminated"), machine.status
    created = [
        call for call in hetzner.requests if call[0] == "POST" and call[1] in ("/servers", "/v1/servers")
    ]
    assert len(created) == 1 and created[0][2] == 201, hetzner.requests
    assert re.search(r'^\{"operator":"[\d.]+","organization":"0\.008000"\}$', out, re.M), out


def _untracked() -> set[str]:
    """Files in the clone that git does not track (nor ignore)."""
    out = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {line[3:] for line in out.splitlines() if line.startswith("??")}


@pytest.mark.e2e
@pytest.mark.timeout(1100)
def test_readme_walkthroughs_run_in_order_as_pasted(stack: dict[str, Any], tmp_path: Path) -> None:
    from apps.events.models import Event
    from apps.jobs.models import Job
    from apps.machines.models import Budget
    from testkit.registry import missing_tools

    blocks = readme_blocks()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = _shell_env(stack, bin_dir)
    clone = ROOT  # where README's reader stands: the clone's folder (its .venv, manage.py)
    before = _untracked()

    assert not missing_tools(), f"the images walkthrough needs {missing_tools()}"
    # Every block that runs, in reading order, in one shell session.
    session = "\n".join(["set -x", *(blocks[name] for name in EXPECTED)])
    try:
        out, err = _run_shell(session, env=env, cwd=clone, timeout=900, tmp=tmp_path)
    finally:
        left_hosts = _stop_hosts(env["CATACLOUD_HOME"])
    assert not left_hosts, f"the hosts walkthrough left host agents running: {left_hosts}"
    left = _untracked() - before  # (files others remove meanwhile are not the walkthroughs' doing)
    assert not left, f"the walkthroughs left files in the clone: {left}"
    # the images walkthrough's registry: its own port and folder, stopped and removed at its end
    port = re.search(r"^\+ REGISTRY_PORT=(\d+)$", err, re.M)
    folder = re.search(r"^\+ REGISTRY_DIR=(\S+)$", err, re.M)
    assert port and folder, err[-3000:]
    assert not Path(folder[1]).exists(), f"the registry's folder {folder[1]} is left"
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", int(port[1]))) != 0, "the registry still listens"

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

    # GitHub Actions: the fake's workflow job ran on a Catacloud machine, by the stand-in runner
    fake = stack["github"]
    (gh_job,) = fake.jobs.values()
    assert (gh_job.status, gh_job.conclusion) == ("completed", "success"), gh_job.as_json()
    assert gh_job.runner_name and gh_job.runner_name.startswith("catacloud-")
    assert "completed with result: success" in out  # the runner's log, through the CLI
    assert "demo-org/app" in out  # jobs show (github: …) and the costs by repository

    # GitLab CI: the fake's CI job ran on a Catacloud machine, by the stand-in gitlab-runner,
    # and its runner was deleted at GitLab; the token never came back
    gl = stack["gitlab"]
    (gl_job,) = gl.jobs.values()
    assert gl_job.status == "success", gl_job.as_json(gl.runners)
    assert gl.runners_seen[gl_job.runner_id or 0].startswith("catacloud-")
    assert not gl.runners and '{"runners":[]}' in out
    assert '"token_set": true' in out and gl.token not in out
    assert "Job succeeded" in out  # the runner's log, through the CLI
    assert "demo-group/app" in out  # jobs show (gitlab: …) and the costs by repository

    # costs and budgets: the CLI's job and machine by their own names, this month's window
    assert re.search(r'"amount": "\d+\.\d+",\s*"currency": "USD"', out), out  # the job's cost, no 404
    assert "start,end,seconds,kind,amount,currency," in out  # export_costs on stdout
    assert '{"period":"month","machine_type":null,"amount":"100.00"}' in out, out  # one answer a line
    assert Budget.objects.filter(machine_type__name="local-small", period="day").exists()

    # managed resources: the demo catalog's types; the job used its token and saw its database
    assert '"id":"ci-token"' in out and '"id":"scratch-db"' in out
    whoami = Job.objects.get(config__name="whoami")
    assert whoami.status == "succeeded" and whoami.exit_code == 0, whoami.status
    assert f'{{"id":"{whoami.pk}","status":"running"}}' in out, out  # its token read its own record
    assert re.search(r"^my database: cc_db_\w+ at [\w.-]+:\d+$", out, re.M), out

    # outputs: the CLI's job's file, printed; the checkpointed job lost its machine after step 3,
    # was requeued, restored its checkpoint on another machine and went on from step 3
    assert re.search(r"^shard 2$", out, re.M), out
    resumed = Job.objects.get(config__name="resumable")
    assert (resumed.status, resumed.attempt, resumed.requeue_reason) == ("succeeded", 2, "machine_terminated")
    second = "".join(resumed.log_chunks.filter(attempt=2).values_list("data", flat=True))
    assert "attempt 2 starts at step 3" in second and second.count("checkpoint saved") == 2, second
    assert Event.objects.filter(kind="checkpoint.restored", job_id=resumed.pk, data__from_attempt=1).exists()
    assert '"other_machine":true' in out and re.search(r"^attempt 2 starts at step 3$", out, re.M), out
    assert "finished at step 5 (attempt 2)" in out

    # the trace: the venv, the services' .env, the demo org's finished jobs
    assert "submit_time_seconds,duration_seconds,config" in out
    assert "ephemeral" in out and "pool:5" in out

    # images: a job ran inside the image, its digest recorded; the next did not pull; a bad
    # reference was refused; the password never came back; the pool's member held the image
    assert "ID=hello-image" in out and re.search(r'"image_digest": "sha256:[0-9a-f]{64}"', out), out
    assert "job.image_cached" in out and "hi from the image" in out
    assert '"code":"invalid_image_reference"' in out and "not-shown-again" not in out
    assert re.search(r'\{"status":"ready","images":\[[^]]*demo/hello:1', out), out
    # containers: the job built an image FROM the registry's with its own Docker and ran it, root
    # in its container and an unprivileged uid outside
    assert "built by docker in a job" in out and '{"status":"succeeded","exit_code":0}' in out, out
    assert re.search(r"^uid 0 in the container, [1-9]\d* outside$", out, re.M), out

    # enrolled hosts: two hosts on this machine ran the jobs in slots, nothing was bought; the
    # drained host's job was requeued and finished on the host taken back; both were revoked,
    # their agents ended their slots and exited, their folder is gone
    _check_hosts_walkthrough(out, err)
    _check_own_cloud_walkthrough(out, stack["hetzner"])

    # Every event kind this run wrote is one the documentation names.
    text = EVENTS_PAGE.read_text()
    unnamed = sorted(
        {k for k in Event.objects.values_list("kind", flat=True).distinct() if f"`{k}`" not in text}
    )
    assert not unnamed, f"event kinds the documentation does not name: {unnamed}"
