"""An organization's GitHub connection and runner classes: the one write path for the API, the
admin console and the catalog (``manage.py apply``). Runner classes are the CI core's
(apps.ci.services); what only GitHub needs (generic labels, scope, the runner folder) is here.
Also the installation token cache the client reads and fills (the rows; the client asks GitHub)."""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from django.conf import settings
from django.db import transaction

from apps.ci import records
from apps.ci import services as ci_services
from apps.ci.services import invalid as _invalid
from apps.ci.services import pool_by_name
from apps.core.actors import Actor
from apps.core.crypto import encrypt_json
from apps.events.kinds import EventKind
from apps.github.choices import GENERIC_LABELS, RunnerScope
from apps.github.forge import GITHUB
from apps.github.models import DEFAULT_API_URL, GitHubConnection, GitHubInstallation, RunnerClass
from apps.orgs.models import Organization

__all__ = ["GENERIC_LABELS", "pool_by_name"]

# The environment variable the runner reads its just-in-time configuration from (the real
# actions/runner reads ACTIONS_RUNNER_INPUT_<OPTION> for a missing --<option> and removes it
# from its environment: src/Runner.Listener/CommandSettings.cs): a secret of the runner job,
# masked in its output, erased when the job ends.
JIT_ENV = "ACTIONS_RUNNER_INPUT_JITCONFIG"
# The runner command when a class names none: a copy of the runner folder the machine's
# image provides (read-only there) in the job's own work folder, so nothing is written into
# the image and every runner starts clean; then one just-in-time run. The configuration stays
# in the environment, never on the command line: any process that shares the machine's /proc
# reads a command line, only the job's own uid reads its environment.
DEFAULT_COMMAND = (
    'cp -R {runner_dir} "$CATACLOUD_WORK_DIR/actions-runner" && cd "$CATACLOUD_WORK_DIR/actions-runner" '
    "&& exec ./run.sh"
)
# ---- label matching ---------------------------------------------------------------------------


def normalise_labels(labels: Any, field: str = "labels") -> list[str]:
    """1-100 labels (GitHub's limit for a runner), lower-case, unique, sorted."""
    return ci_services.normalise_labels(labels, field, limit=100)


def class_matches(class_labels: Iterable[str], job_labels: Iterable[str]) -> bool:
    """GitHub gives a job to a runner whose labels include all of the job's: the class covers a
    job whose labels are a subset of its own and name at least one that is not generic."""
    return records.class_matches(class_labels, job_labels, GENERIC_LABELS)


def match_class(classes: Iterable[RunnerClass], job_labels: Iterable[str]) -> RunnerClass | None:
    """The class for a job: among those covering it, the one with the fewest labels (the most
    specific), then by name. None: the job is meant for other runners."""
    found: RunnerClass | None = records.match_class(classes, job_labels, GENERIC_LABELS)
    return found


# ---- the connection -----------------------------------------------------------------------------


def _check_private_key(pem: str) -> None:
    try:
        key = load_pem_private_key(pem.encode(), password=None)
    except (ValueError, TypeError):
        raise _invalid(
            "private_key", "not a PEM private key (the .pem file GitHub gave for the App)"
        ) from None
    if not isinstance(key, rsa.RSAPrivateKey):
        raise _invalid("private_key", "GitHub App keys are RSA keys")


def _check_api_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise _invalid("api_url", "must be an http(s) URL, e.g. https://api.github.com")
    return url.rstrip("/")


def _installation_ids(value: Any) -> list[tuple[int, str]]:
    if not isinstance(value, list | tuple):
        raise _invalid("installations", "must be a list of installation ids")
    out = []
    for item in value:
        account = ""
        if isinstance(item, dict):
            account = str(item.get("account") or "")
            item = item.get("id")
        if isinstance(item, bool) or not isinstance(item, int) or item <= 0:
            raise _invalid("installations", "each installation id is a positive integer")
        out.append((item, account))
    return out


@transaction.atomic
def connection_set(
    *,
    org: Organization,
    app_id: Any = None,
    api_url: str | None = None,
    private_key: str | None = None,
    webhook_secret: str | None = None,
    installations: Any = None,
    actor: Actor = Actor.UNNAMED,
) -> tuple[GitHubConnection, bool]:
    """Create or change the org's GitHub connection. Secrets given replace the stored ones
    (None keeps them; they are required when creating); ``installations`` given replaces the
    list. Returns (connection, changed). Events name what changed, never a value."""
    conn, creating = ci_services.connection_locked(
        GitHubConnection,
        org=org,
        title="GitHub",
        required={"app_id": app_id, "private_key": private_key, "webhook_secret": webhook_secret},
        app_id=0,
        api_url=DEFAULT_API_URL,
    )
    changed: list[str] = []
    if app_id is not None:
        if isinstance(app_id, bool) or not isinstance(app_id, int) or app_id <= 0:
            raise _invalid("app_id", "must be a positive integer")
        if conn.app_id != app_id:
            conn.app_id = app_id
            changed.append("app_id")
    if api_url is not None:
        url = _check_api_url(api_url)
        if conn.api_url != url:
            conn.api_url = url
            changed.append("api_url")
    if private_key is not None:
        _check_private_key(private_key)
    if webhook_secret is not None and len(webhook_secret) < 8:
        raise _invalid("webhook_secret", "at least 8 characters")
    return ci_services.connection_saved(
        conn,
        org=org,
        actor=actor,
        creating=creating,
        changed=changed,
        secrets={"private_key": private_key, "webhook_secret": webhook_secret},
        children=(
            None
            if installations is None
            else lambda: _set_installations(conn, _installation_ids(installations))
        ),
        events=(EventKind.GITHUB_CONNECTION_CREATED, EventKind.GITHUB_CONNECTION_UPDATED),
        describe={"app_id": conn.app_id},
    )


def _set_installations(conn: GitHubConnection, wanted: list[tuple[int, str]]) -> list[str]:
    return ci_services.children_set(
        forge=GITHUB,
        conn=conn,
        relation="installations",
        key="installation_id",
        label="account",
        wanted=wanted,
        same_forge={"connection__api_url": conn.api_url},
        live_where=lambda row: {"installation": row},
        keep_label_when_empty=True,
    )


def connection_delete(*, org: Organization, actor: Actor = Actor.UNNAMED) -> None:
    ci_services.connection_delete(
        forge=GITHUB,
        model=GitHubConnection,
        org=org,
        actor=actor,
        event=EventKind.GITHUB_CONNECTION_DELETED,
        live_where=lambda conn: {"installation__connection": conn},
        describe=lambda conn: {"app_id": conn.app_id},
    )


# ---- the installation token cache --------------------------------------------------------------

TOKEN_MARGIN = timedelta(minutes=5)  # refresh an installation token this long before it expires


def installation_token_cached(*, installation: GitHubInstallation, now: datetime) -> str | None:
    """The installation's cached token while it is good for :data:`TOKEN_MARGIN` more, else None:
    the one on the instance, or the one on the row (another process may have fetched one; the
    instance takes it)."""
    inst = installation
    if inst.token_encrypted and inst.token_expires_at and inst.token_expires_at - TOKEN_MARGIN > now:
        return inst.token
    fresh = (
        GitHubInstallation.objects.filter(pk=inst.pk).values("token_encrypted", "token_expires_at").first()
    )
    if (
        fresh
        and fresh["token_encrypted"]
        and fresh["token_expires_at"]
        and fresh["token_expires_at"] - TOKEN_MARGIN > now
    ):
        inst.token_encrypted, inst.token_expires_at = fresh["token_encrypted"], fresh["token_expires_at"]
        return inst.token
    return None


def installation_token_store(*, installation: GitHubInstallation, token: str, expires_at: datetime) -> None:
    """Cache a fresh installation token (encrypted) on the row, for every process."""
    installation.token_encrypted = encrypt_json({"token": token})
    installation.token_expires_at = expires_at
    GitHubInstallation.objects.filter(pk=installation.pk).update(
        token_encrypted=installation.token_encrypted, token_expires_at=expires_at
    )


def installation_token_drop(*, installation: GitHubInstallation) -> None:
    """Forget the cached token (GitHub refused it: revoked or expired)."""
    installation.token_encrypted = ""
    installation.token_expires_at = None
    GitHubInstallation.objects.filter(pk=installation.pk).update(token_encrypted="", token_expires_at=None)


# ---- runner classes -----------------------------------------------------------------------------


def runner_command(runner_class: RunnerClass) -> str:
    """What the runner job runs: the class's command, or the default one for its runner folder."""
    if runner_class.command.strip():
        return runner_class.command
    folder = runner_class.runner_dir or settings.CATACLOUD_GITHUB_RUNNER_DIR
    return DEFAULT_COMMAND.format(runner_dir=shlex.quote(folder))


CLASS_FIELDS = (
    "name",
    "labels",
    "machine_type",
    "pool",
    "scope",
    "runner_group_id",
    "command",
    "runner_dir",
    "priority",
    "timeout_seconds",
    "max_attempts",
    "online_timeout_seconds",
    "idle_timeout_seconds",
)


def check_class(rc: RunnerClass) -> None:
    """What only GitHub refuses: generic labels only, an unknown scope."""
    if not set(rc.labels) - GENERIC_LABELS:
        raise _invalid(
            "labels",
            f"name a label besides {', '.join(sorted(GENERIC_LABELS))} (e.g. catacloud-linux-2cpu)",
        )
    if rc.scope not in RunnerScope.values:
        raise _invalid("scope", f"one of {', '.join(RunnerScope.values)}")


def runner_class_save(
    *, org: Organization, runner_class: RunnerClass | None = None, actor: Actor = Actor.UNNAMED, **fields: Any
) -> tuple[RunnerClass, bool]:
    """Create (``runner_class`` None) or change a runner class and the job configuration it
    keeps (``github-<name>``: machine type, command, timeout, priority, attempts; reuse, so a
    machine serves the class's next runner while its paid period lasts). Returns (class, changed)."""
    rc, changed = ci_services.runner_class_save(
        forge=GITHUB,
        org=org,
        fields_allowed=CLASS_FIELDS,
        runner_class=runner_class,
        actor=actor,
        label_limit=100,
        **fields,
    )
    return rc, changed


def runner_class_delete(*, runner_class: RunnerClass, actor: Actor = Actor.UNNAMED) -> None:
    """Delete a class with no live runner (409 ``in_use`` otherwise); its job configuration
    goes too unless jobs refer to it (their records stay)."""
    ci_services.runner_class_delete(forge=GITHUB, runner_class=runner_class, actor=actor)
