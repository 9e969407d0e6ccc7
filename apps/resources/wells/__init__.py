"""Wells create and destroy the resources jobs need, the way providers create machines.

Registered by dotted path (like providers) and loaded on first use. A well gets the
resource's id, the job and the resource type's config, and answers what the job may read
(``metadata``) and what must stay encrypted (``secret``). ``destroy`` must be idempotent.
Raise :class:`WellTransient` for errors worth retrying (the task backs off and retries).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from catacloud.plugins import load_plugin


class WellError(Exception):
    retryable: ClassVar[bool] = False


class WellTransient(WellError):
    retryable = True


class WellPermanent(WellError):
    pass


@dataclass(frozen=True)
class Created:
    external_id: str
    metadata: dict[str, Any] = field(default_factory=dict)
    secret: dict[str, Any] = field(default_factory=dict)


class Well:
    kind: ClassVar[str]

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def create(self, *, resource_id: str, job: Any) -> Created:
        raise NotImplementedError

    def destroy(self, *, resource_id: str, external_id: str, job_id: str | None) -> None:
        raise NotImplementedError


WELLS: dict[str, str] = {
    "api_token": "apps.resources.wells.api_token.ApiTokenWell",
    "postgres_database": "apps.resources.wells.postgres.PostgresDatabaseWell",
    "webhook": "apps.resources.wells.webhook.WebhookWell",
}


def well_class(kind: str) -> type[Well]:
    return load_plugin(WELLS, kind, Well, "well", unknown=WellPermanent)


def build_well(kind: str, config: dict[str, Any]) -> Well:
    return well_class(kind)(dict(config or {}))
