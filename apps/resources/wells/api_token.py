"""``api_token``: a Catacloud API token that reads only the job's own record and events and
stops working when the job ends (revoked at release; expires after the job's timeout anyway)."""

from __future__ import annotations

import contextlib
import uuid
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from apps.core.actors import Actor
from apps.orgs.api.base import JOB_SCOPE
from apps.orgs.models import ApiToken, Membership
from apps.orgs.services import api_token_create, api_token_revoke, membership_set, user_get_or_create
from apps.resources.wells import Created, Well

SERVICE_USER = "catacloud-jobs"


class ApiTokenWell(Well):
    kind = "api_token"

    def create(self, *, resource_id: str, job: Any) -> Created:
        user = job.submitted_by
        if user is None or not Membership.objects.filter(org_id=job.org_id, user=user).exists():
            user = user_get_or_create(username=f"{SERVICE_USER}-{job.org.slug}")
            if not Membership.objects.filter(org_id=job.org_id, user=user).exists():
                membership_set(org=job.org, user=user, role="viewer", actor=Actor.API_TOKEN_WELL)
        lifetime = timedelta(seconds=job.timeout_seconds + int(self.config.get("extra_seconds", 3600)))
        token, secret = api_token_create(
            org=job.org,
            user=user,
            name=f"job {job.pk} ({resource_id})",
            role="viewer",
            expires_at=timezone.now() + lifetime,
            scope=f"{JOB_SCOPE}{job.pk}",
            actor=Actor.API_TOKEN_WELL,
        )
        metadata = {"api_url": settings.CATACLOUD_PUBLIC_URL.rstrip("/") + "/api/v1", "job_id": str(job.pk)}
        return Created(external_id=str(token.pk), metadata=metadata, secret={"token": secret})

    def destroy(self, *, resource_id: str, external_id: str, job_id: str | None) -> None:
        # By id when creation was recorded, else by the resource id in its name (a create
        # whose worker died before recording it, or a release racing the create).
        match = Q(name__endswith=f"({resource_id})")
        with contextlib.suppress(ValueError):
            match |= Q(pk=uuid.UUID(external_id))
        for token in ApiToken.objects.filter(match, revoked_at__isnull=True):
            api_token_revoke(token=token, actor=Actor.API_TOKEN_WELL)
