"""An organization's GitLab connection and runner classes: the one write path for the API, the
admin console and the catalog (``manage.py apply``). Runner classes are the CI core's
(apps.ci.services); what only GitLab needs (scope, executor, the gitlab-runner command) is here."""

from __future__ import annotations

import shlex
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.db import transaction

from apps.ci import services as ci_services
from apps.ci.services import invalid
from apps.core.actors import Actor
from apps.events.kinds import EventKind
from apps.gitlab.choices import Executor, RunnerMode, RunnerScope
from apps.gitlab.forge import GITLAB
from apps.gitlab.models import DEFAULT_URL, GitLabConnection, GitLabRunnerClass
from apps.orgs.models import Organization

# The environment variables of a runner job: the runner's token (a secret of the job, masked in
# its output, erased when the job ends) and GitLab's URL. The runner command takes the token out
# of the environment before gitlab-runner starts (:func:`runner_command`).
TOKEN_ENV = "CI_SERVER_TOKEN"
URL_ENV = "CI_SERVER_URL"
# Class runner mode: the runner manager's system id the runner command keeps beside the config
# (``.runner_system_id``, where gitlab-runner reads it), naming this machine in GitLab's answers.
SYSTEM_ID_ENV = "CATACLOUD_GITLAB_SYSTEM_ID"
# A docker executor's image for jobs that name none (a job's own ``image:`` wins).
DOCKER_DEFAULT_IMAGE = "alpine:latest"
# The runner's name in the config gitlab-runner reads (``run-single --runner``).
CONFIG_RUNNER = "catacloud"

# ---- the connection -----------------------------------------------------------------------------


def _check_url(url: str) -> str:
    parts = urlsplit(url)
    if (
        parts.scheme not in ("http", "https")
        or not parts.netloc
        or parts.query
        or parts.fragment
        or any(c in '"\\' or not c.isprintable() or c.isspace() for c in url)  # a TOML string's value
    ):
        raise invalid("url", "must be an http(s) URL, e.g. https://gitlab.com or https://gitlab.example.com")
    return url.rstrip("/").removesuffix("/api/v4")


def _projects(value: Any) -> list[tuple[int, str]]:
    if not isinstance(value, list | tuple):
        raise invalid("projects", "must be a list of {id, path}")
    out = []
    for item in value:
        if not isinstance(item, dict):
            raise invalid("projects", "each project is {id, path}")
        ident, path = item.get("id"), item.get("path")
        if isinstance(ident, bool) or not isinstance(ident, int) or ident <= 0:
            raise invalid("projects", "each project id is a positive integer")
        if not isinstance(path, str) or "/" not in path.strip("/") or len(path) > 300:
            raise invalid("projects", "each project path is its path with namespace, e.g. acme/app")
        out.append((ident, path.strip("/")))
    return out


@transaction.atomic
def connection_set(
    *,
    org: Organization,
    url: str | None = None,
    token: str | None = None,
    webhook_token: str | None = None,
    projects: Any = None,
    actor: Actor = Actor.UNNAMED,
) -> tuple[GitLabConnection, bool]:
    """Create or change the org's GitLab connection. Secrets given replace the stored ones (None
    keeps them; they are required when creating); ``projects`` given replaces the list. Returns
    (connection, changed). Events name what changed, never a value."""
    conn, creating = ci_services.connection_locked(
        GitLabConnection,
        org=org,
        title="GitLab",
        required={"token": token, "webhook_token": webhook_token},
        url=DEFAULT_URL,
    )
    changed: list[str] = []
    if url is not None:
        clean = _check_url(url)
        if conn.url != clean:
            conn.url = clean
            changed.append("url")
    if token is not None and (not token.strip() or len(token) > 500 or any(c.isspace() for c in token)):
        raise invalid("token", "an access token: one word of at most 500 characters")
    if webhook_token is not None and len(webhook_token) < 8:
        raise invalid("webhook_token", "at least 8 characters")
    return ci_services.connection_saved(
        conn,
        org=org,
        actor=actor,
        creating=creating,
        changed=changed,
        secrets={"token": token, "webhook_token": webhook_token},
        children=None if projects is None else lambda: _set_projects(conn, _projects(projects)),
        events=(EventKind.GITLAB_CONNECTION_CREATED, EventKind.GITLAB_CONNECTION_UPDATED),
        describe={"gitlab": conn.url},
    )


def _set_projects(conn: GitLabConnection, wanted: list[tuple[int, str]]) -> list[str]:
    return ci_services.children_set(
        forge=GITLAB,
        conn=conn,
        relation="projects",
        key="project_id",
        label="path",
        wanted=wanted,
        same_forge={"connection__url": conn.url},
        live_where=lambda row: {"connection": conn, "created_for__project_id": row.project_id},
    )


def connection_delete(*, org: Organization, actor: Actor = Actor.UNNAMED) -> None:
    ci_services.connection_delete(
        forge=GITLAB,
        model=GitLabConnection,
        org=org,
        actor=actor,
        event=EventKind.GITLAB_CONNECTION_DELETED,
        live_where=lambda conn: {"connection": conn},
        describe=lambda conn: {"gitlab": conn.url},
    )


# ---- runner classes -----------------------------------------------------------------------------

CLASS_FIELDS = (
    "name",
    "tags",
    "machine_type",
    "pool",
    "scope",
    "group_id",
    "executor",
    "runner_mode",
    "rotate_hours",
    "image",
    "command",
    "runner_path",
    "priority",
    "timeout_seconds",
    "max_attempts",
    "online_timeout_seconds",
    "idle_timeout_seconds",
)


def _runner_config(executor: str) -> str:
    """The ``[[runners]]`` entry gitlab-runner reads, as a ``printf`` format: GitLab's URL, the
    token and the job's work folder are its arguments (none holds ``"`` or ``\\``, which a TOML
    string would need escaped: the URL is checked when the connection is saved, the token is
    GitLab's, the folder the agent's)."""
    lines = [
        "[[runners]]",
        f'name = "{CONFIG_RUNNER}"',
        'url = "%s"',
        'token = "%s"',
        f'executor = "{executor}"',
        'builds_dir = "%s/builds"',
        'cache_dir = "%s/cache"',
    ]
    if executor == Executor.DOCKER:
        # network_mode "host" (gitlab-runner's [runners.docker] network_mode, its NetworkMode):
        # the CI job's containers and services use the job's own network namespace, where every
        # rule of the job network holds, and services answer on localhost. Docker's default (its
        # bridge, with links between containers) is Docker's own: Podman's compatible API made a
        # rootless network of it that needs slirp4netns.
        lines += ["[runners.docker]", f'image = "{DOCKER_DEFAULT_IMAGE}"', 'network_mode = "host"']
    return "\\n".join(lines) + "\\n"


def runner_command(runner_class: GitLabRunnerClass) -> str:
    """What the runner job runs: the class's command, or ``gitlab-runner run-single`` for one job
    (``--max-builds 1``), waiting at most the class's idle timeout for it, its work in the job's
    folder.

    The runner's token never reaches the CI job's processes. gitlab-runner's shell executor gives
    a job's script the runner's whole environment (gitlab-runner ``executors/shell/shell.go``:
    ``Env: os.Environ()``) and any process of the job's uid reads the runner's command line and
    environment in ``/proc``, so the token is in neither: the shell takes it out of its
    environment and writes the runner's config (``run-single --config FILE --runner NAME``,
    gitlab-runner 17.1 and later) into a FIFO in a 0700 folder of the job's own, which
    gitlab-runner reads once, at start, before it asks for a job. Nothing is left to read there
    afterwards (a FIFO keeps no data; opening it again waits for a writer that is gone), and
    what held the token (the writer, the shell) is gone before any CI job starts."""
    if runner_class.command.strip():
        return runner_class.command
    binary = runner_class.runner_path or settings.CATACLOUD_GITLAB_RUNNER
    executor = runner_class.executor or Executor.SHELL
    config = '"$d/config.toml"'
    return (
        f'd=$(mktemp -d "$CATACLOUD_WORK_DIR/gitlab-runner.XXXXXX") && mkfifo {config} '
        f'&& {{ [ -z "${SYSTEM_ID_ENV}" ] || printf %s "${SYSTEM_ID_ENV}" > "$d/.runner_system_id"; }} '
        f'&& t="${TOKEN_ENV}" && unset {TOKEN_ENV} '
        f'&& {{ printf {shlex.quote(_runner_config(executor))} "${URL_ENV}" "$t" '
        f'"$CATACLOUD_WORK_DIR" "$CATACLOUD_WORK_DIR" > {config} & }} && t= '
        f"&& exec {shlex.quote(binary)} run-single --config {config} --runner {CONFIG_RUNNER} "
        f"--max-builds 1 --wait-timeout {runner_class.idle_timeout_seconds}"
    )


def check_class(rc: GitLabRunnerClass) -> None:
    """What only GitLab refuses: an unknown scope or executor, a group runner without a group."""
    if rc.scope not in RunnerScope.values:
        raise invalid("scope", f"one of {', '.join(RunnerScope.values)}")
    if rc.scope == RunnerScope.GROUP and not rc.group_id:
        raise invalid("group_id", "a group runner class names its GitLab group id")
    if rc.executor not in Executor.values:
        raise invalid("executor", f"one of {', '.join(Executor.values)}")
    if rc.executor == Executor.DOCKER and not rc.machine_type.containers:
        raise invalid(
            "executor",
            f"docker needs a machine type with containers: true (machine type {rc.machine_type.name} "
            "has containers: false), or use executor shell",
        )
    if rc.runner_mode not in RunnerMode.values:
        raise invalid("runner_mode", f"one of {', '.join(RunnerMode.values)}")


def runner_class_save(
    *,
    org: Organization,
    runner_class: GitLabRunnerClass | None = None,
    actor: Actor = Actor.UNNAMED,
    **fields: Any,
) -> tuple[GitLabRunnerClass, bool]:
    """Create (``runner_class`` None) or change a runner class and the job configuration it
    keeps (``gitlab-<name>``: machine type, command, image, timeout, priority, attempts; reuse,
    so a machine serves the class's next runner while its paid period lasts)."""
    rc, changed = ci_services.runner_class_save(
        forge=GITLAB, org=org, fields_allowed=CLASS_FIELDS, runner_class=runner_class, actor=actor, **fields
    )
    return rc, changed


def runner_class_delete(*, runner_class: GitLabRunnerClass, actor: Actor = Actor.UNNAMED) -> None:
    ci_services.runner_class_delete(forge=GITLAB, runner_class=runner_class, actor=actor)
