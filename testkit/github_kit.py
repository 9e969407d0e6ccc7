"""GitHub Actions set-ups the tests, the benchmark and ``make dev`` share: an org connected to a
fake GitHub (``testkit.github_fake``) with runner classes that run the stand-in runner.

Models and services are imported inside the functions: importable before ``django.setup()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from apps.core.actors import Actor
from testkit.github_fake import FakeGitHub

# The stand-in runner's folder: what a machine's image provides at /opt/actions-runner. A local
# machine is a sandbox that sees none of this checkout: its provider account's ``mounts`` shows
# the folder there, read-only, and classes keep the default runner_dir.
RUNNER_DIR = Path(__file__).resolve().parent / "github_runner"
RUNNER_TARGET = "/opt/actions-runner"
RUNNER_MOUNT = {"source": str(RUNNER_DIR), "target": RUNNER_TARGET}
WEBHOOK_PATH = "/api/integrations/github/webhook"


def expose_runner(account: Any) -> None:
    """Show the stand-in runner at /opt/actions-runner in every machine of a local ``account``
    started from now on (like an image: a machine already running never sees it, so call this
    before a pool of the account warms)."""
    if account.kind != "local":
        return
    mounts = [m for m in account.config.get("mounts") or [] if m.get("target") != RUNNER_TARGET]
    account.config["mounts"] = [*mounts, RUNNER_MOUNT]
    account.save(update_fields=["config", "updated_at"])


def allow_loopback(machine_type: Any, url: str) -> None:
    """Let jobs of ``machine_type`` reach the service at ``url`` on this host's loopback (the fake
    GitHub the stand-in runner talks to), through the machine type's ``network.allow`` as an
    operator's cache would be: a job's network reaches nothing else of the host."""
    from urllib.parse import urlsplit

    from apps.machines.services import machine_type_update

    entry = f"127.0.0.1:{urlsplit(url).port}"
    allow = list((machine_type.network or {}).get("allow") or [])
    if entry not in allow:
        machine_type_update(
            machine_type=machine_type, actor=Actor.TESTKIT, network={"allow": [*allow, entry]}
        )
        machine_type.refresh_from_db()


def connect(
    org: Any,
    fake: FakeGitHub,
    private_key: str,
    *,
    installation_id: int,
    account: str,
    classes: Iterable[Mapping[str, Any]],
    runner_dir: str = RUNNER_TARGET,
) -> list[Any]:
    """Connect ``org`` to ``fake`` (its App id and webhook secret) and save ``classes``
    (``{name, labels, machine_type, pool?, ...}``) running the stand-in runner, shown in the
    local machines of their machine types (``expose_runner``). Returns them."""
    from apps.github.services import connection_set, runner_class_save

    connection_set(
        org=org,
        app_id=fake.app_id,
        api_url=fake.url,
        private_key=private_key,
        webhook_secret=fake.webhook_secret,
        installations=[{"id": installation_id, "account": account}],
        actor=Actor.TESTKIT,
    )
    saved = []
    for spec in classes:
        rc, _ = runner_class_save(org=org, actor=Actor.TESTKIT, **{"runner_dir": runner_dir, **spec})
        saved.append(rc)
        expose_runner(rc.machine_type.provider_account)
        allow_loopback(rc.machine_type, fake.url)
    return saved
