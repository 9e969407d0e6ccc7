"""The reaper's rules for GitHub Actions: the CI core's (apps.ci.convergence) for GitHub. The
reaper runs every registered forge's (``apps.ci.convergence.ci_converge``)."""

from __future__ import annotations

from datetime import datetime

from apps.ci.convergence import forge_converge
from apps.github.forge import GITHUB


def github_converge(*, now: datetime) -> dict[str, int]:
    return forge_converge(forge=GITHUB, now=now)
