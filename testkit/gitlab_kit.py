"""GitLab CI set-ups the tests, the benchmark and ``make dev`` share: an org connected to a fake
GitLab (``testkit.gitlab_fake``) with runner classes that run the stand-in ``gitlab-runner``.

Models and services are imported inside the functions: importable before ``django.setup()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from apps.core.actors import Actor
from testkit.forge_common import allow_loopback, classes_saved, expose_mount
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
    expose_mount(account, RUNNER_MOUNT)


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
    return classes_saved(
        org,
        fake.url,
        classes,
        save=runner_class_save,
        expose_runner=expose_runner,
        defaults={"runner_path": runner_path},
    )
