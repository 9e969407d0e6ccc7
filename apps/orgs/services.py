from __future__ import annotations

from datetime import datetime

from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from apps.core.actors import Actor
from apps.core.crypto import hash_token, new_token
from apps.core.errors import ErrorCode, NotFound, ValidationFailed
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.orgs.auth import TOKEN_PREFIX
from apps.orgs.choices import ROLE_RANK, Role
from apps.orgs.models import ApiToken, Membership, Organization, Privilege


def _role(role: str) -> Role:
    try:
        return Role(role)
    except ValueError:
        raise ValidationFailed(
            f"unknown role {role!r}; use one of {', '.join(Role.values)}", fields={"role": ["unknown role"]}
        ) from None


@transaction.atomic
def membership_set(*, org: Organization, user: User, role: str, actor: Actor = Actor.UNNAMED) -> Membership:
    """Give ``user`` the ``role`` in ``org`` (creating the membership if needed)."""
    role = _role(role)
    membership, changed = Membership.objects.get_or_create(org=org, user=user, defaults={"role": role})
    if membership.role != role:
        membership.role = role
        membership.save(update_fields=["role"])
        changed = True
    if changed:
        event_record(kind=EventKind.ORG_MEMBER_SET, org=org, actor=actor, user=user.get_username(), role=role)
    return membership


@transaction.atomic
def membership_delete(*, membership: Membership, actor: Actor = Actor.UNNAMED) -> None:
    """Remove a user from an org; the user's tokens in that org stop working with it."""
    org, user = membership.org, membership.user
    revoked = ApiToken.objects.filter(org=org, user=user, revoked_at__isnull=True).update(
        revoked_at=timezone.now()
    )
    Membership.objects.filter(pk=membership.pk).delete()
    event_record(
        kind=EventKind.ORG_MEMBER_REMOVED,
        org=org,
        actor=actor,
        user=user.get_username(),
        tokens_revoked=revoked,
    )


def user_get_or_create(*, username: str) -> User:
    user, _ = get_user_model().objects.get_or_create(username=username)
    return user


@transaction.atomic
def api_token_create(
    *,
    org: Organization,
    user: User,
    name: str = "",
    role: str = "",
    expires_at: datetime | None = None,
    scope: str = "",
    actor: Actor = Actor.UNNAMED,
) -> tuple[ApiToken, str]:
    """Mint a token for ``user`` in ``org``. Returns the row and the secret, shown only once.

    The user must be a member of ``org``; ``role`` may narrow the member's role, never widen it;
    ``scope`` narrows it further (``job:<uuid>``: that job only).
    """
    membership = Membership.objects.filter(org=org, user=user).first()
    if membership is None:
        raise NotFound(f"{user.get_username()} is not a member of {org.slug}", code=ErrorCode.NOT_A_MEMBER)
    if role:
        wanted = _role(role)
        if ROLE_RANK[wanted] > ROLE_RANK[Role(membership.role)]:
            raise ValidationFailed(
                f"a token cannot have more rights ({wanted}) than its user ({membership.role})",
                fields={"role": ["wider than the user's role"]},
            )
    secret = new_token(TOKEN_PREFIX)
    token = ApiToken.objects.create(
        org=org,
        user=user,
        name=name,
        role=role,
        prefix=secret[:10],
        token_hash=hash_token(secret),
        expires_at=expires_at,
        scope=scope,
    )
    event_record(
        kind=EventKind.ORG_TOKEN_CREATED, org=org, actor=actor, token=str(token.pk), user=user.get_username()
    )
    return token, secret


@transaction.atomic
def api_token_revoke(*, token: ApiToken, actor: Actor = Actor.UNNAMED) -> bool:
    """Revoke a token. Returns False when it was already revoked (idempotent)."""
    updated = ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
    if updated:
        event_record(kind=EventKind.ORG_TOKEN_REVOKED, org=token.org_id, actor=actor, token=str(token.pk))
    return bool(updated)


@transaction.atomic
def privilege_grant(*, org: Organization, name: str, actor: Actor = Actor.UNNAMED) -> Privilege:
    privilege, _ = Privilege.objects.get_or_create(name=name)
    if not org.privileges.filter(pk=privilege.pk).exists():
        org.privileges.add(privilege)
        event_record(kind=EventKind.ORG_PRIVILEGE_GRANTED, org=org, actor=actor, privilege=name)
    return privilege


@transaction.atomic
def privilege_revoke(*, org: Organization, name: str, actor: Actor = Actor.UNNAMED) -> bool:
    """Take a privilege away (machines and jobs already admitted keep running). Returns False
    when the org did not have it."""
    privilege = Privilege.objects.filter(name=name).first()
    if privilege is None or not org.privileges.filter(pk=privilege.pk).exists():
        return False
    org.privileges.remove(privilege)
    event_record(kind=EventKind.ORG_PRIVILEGE_REVOKED, org=org, actor=actor, privilege=name)
    return True
