"""Organizations: members, tokens and privileges change through services that record what they
did; a member removed loses the tokens that acted for them in that org."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from apps.core.errors import NotFound, ValidationFailed
from apps.events.models import Event
from apps.orgs.models import ApiToken, Membership
from apps.orgs.services import (
    api_token_create,
    api_token_revoke,
    membership_delete,
    membership_set,
    privilege_grant,
    privilege_revoke,
)
from tests.conftest import World

pytestmark = pytest.mark.django_db


def test_a_removed_member_s_tokens_stop_working_in_that_org_only(world: World) -> None:
    member = get_user_model().objects.get(username="member")
    assert world.client("member").get("/api/v1/pools/").status_code == 200
    membership_delete(membership=Membership.objects.get(org=world.org, user=member), actor="test")
    assert world.client("member").get("/api/v1/pools/").status_code == 401
    event = Event.objects.get(kind="org.member_removed", org=world.org)
    assert event.data == {"user": "member", "tokens_revoked": 1}


def test_a_token_is_never_wider_than_its_user_and_only_for_members(world: World) -> None:
    viewer = get_user_model().objects.get(username="viewer")
    with pytest.raises(ValidationFailed, match="more rights"):
        api_token_create(org=world.org, user=viewer, role="admin")
    outsider = get_user_model().objects.get(username="outsider")
    with pytest.raises(NotFound) as refused:
        api_token_create(org=world.org, user=outsider)
    assert refused.value.code == "not_a_member"
    token, secret = api_token_create(org=world.org, user=viewer, name="ci", actor="test")
    assert secret not in token.token_hash and token.prefix == secret[:10]
    assert api_token_revoke(token=token) is True
    assert api_token_revoke(token=token) is False  # already revoked: nothing recorded twice
    assert Event.objects.filter(kind="org.token_revoked", data__token=str(token.pk)).count() == 1
    assert ApiToken.objects.get(pk=token.pk).revoked_at is not None


def test_roles_and_privileges_are_recorded_once_per_change(world: World) -> None:
    viewer = get_user_model().objects.get(username="viewer")
    membership_set(org=world.org, user=viewer, role="member", actor="test")
    membership_set(org=world.org, user=viewer, role="member", actor="test")  # no change
    assert Event.objects.filter(kind="org.member_set", data__user="viewer", data__role="member").count() == 1
    with pytest.raises(ValidationFailed, match="unknown role"):
        membership_set(org=world.org, user=viewer, role="owner")
    privilege_grant(org=world.org, name="gpu", actor="test")
    privilege_grant(org=world.org, name="gpu", actor="test")
    assert world.org.privileges.filter(name="gpu").exists()
    assert Event.objects.filter(kind="org.privilege_granted", org=world.org).count() == 1
    assert privilege_revoke(org=world.org, name="gpu") is True
    assert privilege_revoke(org=world.org, name="gpu") is False
    world.org.refresh_from_db()
    assert not world.org.privileges.filter(name="gpu").exists()
