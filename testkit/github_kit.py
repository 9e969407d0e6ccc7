"""GitHub Actions set-ups the tests, the benchmark and ``make dev`` share: an org connected to a
fake GitHub (``testkit.github_fake``) with runner classes that run the stand-in runner.

Models and services are imported inside the functions: importable before ``django.setup()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from apps.core.actors import Actor
from testkit.forge_common import allow_loopback, classes_saved, expose_mount
from testkit.github_fake import FakeGitHub

__all__ = [
    "RUNNER_DIR",
    "RUNNER_MOUNT",
    "RUNNER_TARGET",
    "WEBHOOK_PATH",
    "allow_loopback",
    "connect",
    "expose_runner",
]

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
    expose_mount(account, RUNNER_MOUNT)


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
    return classes_saved(
        org,
        fake.url,
        classes,
        save=runner_class_save,
        expose_runner=expose_runner,
        defaults={"runner_dir": runner_dir},
    )
