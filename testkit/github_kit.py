"""GitHub Actions set-ups the tests, the benchmark and ``make dev`` share: an org connected to a
fake GitHub (``testkit.github_fake``) with runner classes that run the stand-in runner.

Models and services are imported inside the functions: importable before ``django.setup()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from testkit.github_fake import FakeGitHub

# The stand-in runner's folder: what a machine's image provides at /opt/actions-runner. Local
# machines see the host's folders today; once they are sandboxes, the local provider account's
# ``mounts`` exposes this folder there instead and classes keep the default runner_dir.
RUNNER_DIR = Path(__file__).resolve().parent / "github_runner"
WEBHOOK_PATH = "/api/integrations/github/webhook"


def connect(
    org: Any,
    fake: FakeGitHub,
    private_key: str,
    *,
    installation_id: int,
    account: str,
    classes: Iterable[Mapping[str, Any]],
    runner_dir: str = str(RUNNER_DIR),
) -> list[Any]:
    """Connect ``org`` to ``fake`` (its App id and webhook secret) and save ``classes``
    (``{name, labels, machine_type, pool?, ...}``) running the stand-in runner. Returns them."""
    from apps.github.services import connection_set, runner_class_save

    connection_set(
        org=org,
        app_id=fake.app_id,
        api_url=fake.url,
        private_key=private_key,
        webhook_secret=fake.webhook_secret,
        installations=[{"id": installation_id, "account": account}],
        actor="testkit",
    )
    saved = []
    for spec in classes:
        rc, _ = runner_class_save(org=org, actor="testkit", **{"runner_dir": runner_dir, **spec})
        saved.append(rc)
    return saved
