"""GitLab CI set-ups the tests, the benchmark and ``make dev`` share: an org connected to a fake
GitLab (``testkit.gitlab_fake``) with runner classes that run the stand-in ``gitlab-runner``.

Models and services are imported inside the functions: importable before ``django.setup()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from apps.core.actors import Actor
from testkit.github_kit import allow_loopback
from testkit.gitlab_fake import FakeGitLab

__all__ = ["RUNNER_MOUNT", "RUNNER_PATH", "WEBHOOK_PATH", "allow_loopback", "connect", "expose_runner"]

# The stand-in gitlab-runner's folder: what a machine's image provides at /opt/gitlab-runner. A
# local machine is a sandbox that sees none of this checkout: its provider account's ``mounts``
# shows the folder there, read-only, and classes name the binary in it (``runner_path``).
RUNNER_DIR = Path(__file__).resolve().parent / "gitlab_runner"
RUNNER_TARGET = "/opt/gitlab-runner"
RUNNER_PATH = f"{RUNNER_TARGET}/gitlab-runner"
RUNNER_MOUNT = {"source": str(RUNNER_DIR), "target": RUNNER_TARGET}
WEBHOOK_PATH = "/api/integrations/gitlab/webhook"


def expose_runner(account: Any) -> None:
    """Show the stand-in gitlab-runner at /opt/gitlab-runner in every machine of a local
    ``account`` started from now on (like an image: call this before a pool of the account warms)."""
    if account.kind != "local":
        return
    mounts = [m for m in account.config.get("mounts") or [] if m.get("target") != RUNNER_TARGET]
    account.config["mounts"] = [*mounts, RUNNER_MOUNT]
    account.save(update_fields=["config", "updated_at"])


def connect(
    org: Any,
    fake: FakeGitLab,
    *,
    projects: Iterable[tuple[int, str]],
    classes: Iterable[Mapping[str, Any]],
    runner_path: str = RUNNER_PATH,
) -> list[Any]:
    """Connect ``org`` to ``fake`` (its token and webhook token, ``projects``) and save
    ``classes`` (``{name, tags, machine_type, pool?, ...}``) running the stand-in runner, shown
    in the local machines of their machine types, whose jobs may reach the fake. Returns them."""
    from apps.gitlab.services import connection_set, runner_class_save

    connection_set(
        org=org,
        url=fake.url,
        token=fake.token,
        webhook_token=fake.webhook_token,
        projects=[{"id": pid, "path": path} for pid, path in projects],
        actor=Actor.TESTKIT,
    )
    saved = []
    for spec in classes:
        rc, _ = runner_class_save(org=org, actor=Actor.TESTKIT, **{"runner_path": runner_path, **spec})
        saved.append(rc)
        expose_runner(rc.machine_type.provider_account)
        allow_loopback(rc.machine_type, fake.url)
    return saved
