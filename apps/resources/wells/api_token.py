"""``api_token``: a Catacloud API token that reads only the job's own record and events and
stops working when the job ends (revoked at release; expires after the job's timeout anyway)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

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
                membership_set(org=job.org, user=user, role="viewer", actor="api_token well")
        lifetime = timedelta(seconds=job.timeout_seconds + int(self.config.get("extra_seconds", 3600)))
        token, secret = api_token_create(
            org=job.org,
            user=user,
            name=f"job {job.pk} ({resource_id})",
            role="viewer",
            expires_at=timezone.now() + lifetime,
            job=job,
            actor="api_token well",
        )
        metadata = {"api_url": settings.CATACLOUD_PUBLIC_URL.rstrip("/") + "/api/v1", "job_id": str(job.pk)}
        return Created(external_id=str(token.pk), metadata=metadata, secret={"token": secret})

    def destroy(self, *, resource_id: str, external_id: str, job_id: str | None) -> None:
        token = ApiToken.objects.filter(pk=external_id).first()
        if token is not None:
            api_token_revoke(token=token, actor="api_token well")
