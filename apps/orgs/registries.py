"""An organization's container registry credentials: set (write-only), removed, and handed to
the agent that pulls an image from their registry host, and to nobody else."""

from __future__ import annotations

from django.db import transaction

from apps.core.actors import Actor
from apps.core.errors import ErrorCode, ValidationFailed
from apps.core.ids import OrgId
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.orgs.models import Organization, RegistryCredential
from catacloud.agent.reference import parse, registry_host


@transaction.atomic
def registry_credential_set(
    *, org: Organization, registry: str, username: str, password: str, actor: Actor = Actor.UNNAMED
) -> RegistryCredential:
    """Create or replace the credentials for ``registry`` (a host, or host:port): one per host
    and organization. The password is stored encrypted and never returned."""
    try:
        host = registry_host(registry)
    except ValueError as exc:
        raise ValidationFailed(
            f"registry: {exc}", fields={"registry": [str(exc)]}, code=ErrorCode.INVALID_IMAGE_REFERENCE
        ) from None
    if not username or not password:
        raise ValidationFailed.field("password" if username else "username", "must not be empty")
    credential = RegistryCredential.objects.filter(org=org, registry=host).first() or RegistryCredential(
        org=org, registry=host
    )
    created = credential.pk is None or credential._state.adding
    credential.username = username
    credential.password = password
    credential.save()
    event_record(
        kind=EventKind.ORG_REGISTRY_CREDENTIAL_SET,
        org=org,
        actor=actor,
        registry=host,
        username=username,
        created=created,
    )
    return credential


@transaction.atomic
def registry_credential_delete(*, credential: RegistryCredential, actor: Actor = Actor.UNNAMED) -> None:
    event_record(
        kind=EventKind.ORG_REGISTRY_CREDENTIAL_DELETED,
        org=credential.org_id,
        actor=actor,
        registry=credential.registry,
    )
    credential.delete()


def registry_auth_for(*, org_id: OrgId, reference: str) -> tuple[str, str] | None:
    """(username, password) of the organization for the registry ``reference`` names, or None."""
    try:
        host = parse(reference).registry
    except ValueError:
        return None
    row = RegistryCredential.objects.filter(org_id=org_id, registry=host).first()
    return (row.username, row.password) if row is not None else None


def registry_logins_for(*, org_id: OrgId) -> list[tuple[str, str, str]]:
    """(registry, username, password) of every registry the organization holds credentials for:
    what a containers job's engine pulls with, through its agent (never handed to the job)."""
    rows = RegistryCredential.objects.filter(org_id=org_id)
    return [(row.registry, row.username, row.password) for row in rows]


def check_image_reference(value: object, *, field: str = "image") -> str:
    """An image reference as given (``registry/repository:tag`` or ``…@sha256:<digest>``),
    normalised; or a 400 ``invalid_image_reference`` naming ``field``."""
    try:
        return str(parse(value))
    except ValueError as exc:
        raise ValidationFailed(
            f"{field}: {exc}", fields={field: [str(exc)]}, code=ErrorCode.INVALID_IMAGE_REFERENCE
        ) from None
