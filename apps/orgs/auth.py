"""``Authorization: Bearer <token>`` for the public API."""

from __future__ import annotations

import functools
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.db import connection
from django.db.models import Model
from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from apps.core.crypto import hash_token
from apps.core.db import fetch_one_prepared
from apps.orgs.models import ApiToken, Membership, Organization

TOKEN_PREFIX = "cc"
# last_used_at is written at most this often per token, to keep reads cheap.
LAST_USED_RESOLUTION = timedelta(seconds=60)


def _columns(model: type[Model], alias: str) -> tuple[str, list[str]]:
    fields = model._meta.concrete_fields
    return ", ".join(f"{alias}.{connection.ops.quote_name(str(f.column))}" for f in fields), [
        f.attname for f in fields
    ]


@functools.cache
def _lookup_sql() -> tuple[str, list[str], list[str], list[str]]:
    token_cols, token_names = _columns(ApiToken, "t")
    user_cols, user_names = _columns(get_user_model(), "u")
    org_cols, org_names = _columns(Organization, "o")
    sql = f"""
SELECT {token_cols}, {user_cols}, {org_cols}, m.role
FROM {ApiToken._meta.db_table} t
JOIN {get_user_model()._meta.db_table} u ON u.id = t.user_id
JOIN {Organization._meta.db_table} o ON o.id = t.org_id
LEFT JOIN {Membership._meta.db_table} m ON m.org_id = t.org_id AND m.user_id = t.user_id
WHERE t.token_hash = %s AND t.revoked_at IS NULL
"""
    return sql, token_names, user_names, org_names


def token_lookup(token_hash: str) -> ApiToken | None:
    """The live token with this hash, its user, its org and the user's role there
    (``member_role``, None when no longer a member): one hand-written query, since this runs
    on every API call and the ORM's query building cost more than the query."""
    sql, token_names, user_names, org_names = _lookup_sql()
    row = fetch_one_prepared(sql, [token_hash])
    if row is None:
        return None
    n_token, n_user = len(token_names), len(user_names)
    token = ApiToken.from_db(connection.alias, token_names, row[:n_token])
    token.user = get_user_model().from_db(connection.alias, user_names, row[n_token : n_token + n_user])
    token.org = Organization.from_db(connection.alias, org_names, row[n_token + n_user : -1])
    token.member_role = row[-1]  # type: ignore[attr-defined]  # the caller's role, from the join
    return token


class BearerTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple | None:
        header = authentication.get_authorization_header(request).decode("latin-1")
        if not header:
            return None
        parts = header.split()
        if parts[0].lower() != self.keyword.lower():
            # Another scheme (``Token cc_…``, ``Basic …``) or a bare token: say what to send
            # instead of "credentials were not provided".
            scheme = "no scheme" if parts[0].startswith(f"{TOKEN_PREFIX}_") else f"the scheme {parts[0]!r}"
            raise exceptions.AuthenticationFailed(
                f"the Authorization scheme is Bearer: send 'Authorization: Bearer <token>' (got {scheme})"
            )
        if len(parts) != 2:
            raise exceptions.AuthenticationFailed("Authorization header must be 'Bearer <token>'")
        token = parts[1]
        if not token.startswith(f"{TOKEN_PREFIX}_"):
            raise exceptions.AuthenticationFailed("invalid token")
        now = timezone.now()
        api_token = token_lookup(hash_token(token))
        if api_token is None or not api_token.user.is_active:
            raise exceptions.AuthenticationFailed("invalid or revoked token")
        if api_token.expires_at is not None and api_token.expires_at <= now:
            raise exceptions.AuthenticationFailed("token expired")
        if api_token.last_used_at is None or now - api_token.last_used_at > LAST_USED_RESOLUTION:
            ApiToken.objects.filter(pk=api_token.pk).update(last_used_at=now)
        return api_token.user, api_token

    def authenticate_header(self, request: Request) -> str:
        return self.keyword


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "apps.orgs.auth.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema: object) -> dict:
        return {"type": "http", "scheme": "bearer"}
