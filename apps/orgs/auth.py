"""``Authorization: Bearer <token>`` for the public API."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from apps.core.crypto import hash_token
from apps.orgs.models import ApiToken

TOKEN_PREFIX = "cc"
# last_used_at is written at most this often per token, to keep reads cheap.
LAST_USED_RESOLUTION = timedelta(seconds=60)


class BearerTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple | None:
        header = authentication.get_authorization_header(request).decode("latin-1")
        if not header:
            return None
        parts = header.split()
        if parts[0].lower() != self.keyword.lower():
            return None
        if len(parts) != 2:
            raise exceptions.AuthenticationFailed("Authorization header must be 'Bearer <token>'")
        token = parts[1]
        if not token.startswith(f"{TOKEN_PREFIX}_"):
            raise exceptions.AuthenticationFailed("invalid token")
        now = timezone.now()
        api_token = (
            ApiToken.objects.select_related("user", "org", "job")
            .filter(token_hash=hash_token(token), revoked_at__isnull=True)
            .first()
        )
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
