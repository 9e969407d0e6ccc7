"""The GitHub reconciler: the CI core's (apps.ci.reconcile), per installation, every
``CATACLOUD_GITHUB_RECONCILE_INTERVAL`` seconds: runners whose machine or job is gone deleted,
runners that never came online recycled, idle ones retired; the installation's queued and
in-progress runs polled for missed webhooks (with backoff) and the App's failed deliveries
redelivered (apps.github.ops)."""

from __future__ import annotations

from datetime import datetime

from apps.ci import reconcile as ci_reconcile
from apps.core.ids import GitHubInstallationId
from apps.github.forge import GITHUB


def interval() -> float:
    return ci_reconcile.interval(GITHUB)


def reconciles_due(*, now: datetime) -> int:
    return ci_reconcile.reconciles_due(forge=GITHUB, now=now)


def installation_reconcile(
    *, installation_id: GitHubInstallationId, now: datetime | None = None
) -> dict[str, int]:
    """One reconcile of one installation (skipped while another holds it)."""
    return ci_reconcile.endpoint_reconcile(forge=GITHUB, endpoint_id=installation_id, now=now)
