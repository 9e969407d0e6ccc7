"""What every API view shares: one error format, and tenancy in one place.

Errors: ``{"code": "snake_case", "detail": "a sentence", ...}`` for every 4xx; validation
errors add ``fields``. Unexpected exceptions are logged and answered with a bare 500.

Tenancy: :class:`OrgScopedViewSet` filters every queryset by the caller's organization, so
another org's object is a 404 exactly like a missing one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.db import DataError
from django.db.models import ProtectedError, QuerySet
from django.http import Http404
from rest_framework import exceptions, permissions, status, viewsets
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.errors import DomainError, ValidationFailed
from apps.orgs.choices import ROLE_RANK, Role
from apps.orgs.models import ApiToken, Membership, Organization

log = logging.getLogger(__name__)


def _flatten(detail: Any) -> Any:
    if isinstance(detail, dict):
        return {k: _flatten(v) for k, v in detail.items()}
    if isinstance(detail, list):
        return [_flatten(v) for v in detail]
    return str(detail)


def _messages(value: Any, prefix: str = "") -> list[str]:
    """Any nesting of DRF error details as a flat list of sentences (``key: message``)."""
    if isinstance(value, dict):
        return [m for k, v in value.items() for m in _messages(v, f"{prefix}{k}: ")]
    if isinstance(value, list):
        return [m for v in value for m in _messages(v, prefix)]
    return [f"{prefix}{value}"]


_DRF_CODES = {
    exceptions.NotAuthenticated: "not_authenticated",
    exceptions.AuthenticationFailed: "authentication_failed",
    exceptions.PermissionDenied: "permission_denied",
    exceptions.NotFound: "not_found",
    exceptions.MethodNotAllowed: "method_not_allowed",
    exceptions.NotAcceptable: "not_acceptable",
    exceptions.UnsupportedMediaType: "unsupported_media_type",
    exceptions.Throttled: "throttled",
    exceptions.ParseError: "parse_error",
}


def error_response(status_code: int, code: str, detail: str, **extra: Any) -> Response:
    return Response({"code": code, "detail": detail, **extra}, status=status_code)


def exception_handler(exc: Exception, context: dict) -> Response:
    if isinstance(exc, ValidationFailed):
        return error_response(exc.status, exc.code, exc.detail, fields=exc.fields)
    if isinstance(exc, DomainError):
        return error_response(exc.status, exc.code, exc.detail, **exc.extra)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    elif isinstance(exc, ProtectedError):
        return error_response(409, "in_use", "this object is still used by others and cannot be deleted")
    elif isinstance(exc, DataError):
        # A value PostgreSQL cannot store or compare (out of range date, offset, number).
        return error_response(400, "invalid", "a value is out of the range the database accepts")
    if isinstance(exc, exceptions.ValidationError):
        raw = exc.detail if isinstance(exc.detail, dict) else {"non_field_errors": exc.detail}
        fields = {str(k): _messages(v) for k, v in raw.items()}
        name, messages = next(iter(fields.items()), ("", ["invalid input"]))
        message = messages[0] if messages else "invalid input"
        detail = message if name == "non_field_errors" else f"{name}: {message}"
        return error_response(400, "invalid", detail, fields=fields)
    if isinstance(exc, exceptions.APIException):
        code = next((c for cls, c in _DRF_CODES.items() if isinstance(exc, cls)), None)
        if code is None:
            code = exc.default_code if isinstance(exc.default_code, str) else "error"
        response = error_response(exc.status_code, code, str(_flatten(exc.detail)))
        if getattr(exc, "auth_header", None):
            response["WWW-Authenticate"] = exc.auth_header
        if getattr(exc, "wait", None):
            response["Retry-After"] = str(int(exc.wait))
        return response
    view = context.get("view")
    log.exception("unhandled error in %s", type(view).__name__ if view else "API view")
    return error_response(status.HTTP_500_INTERNAL_SERVER_ERROR, "server_error", "internal error")


# ---- tenancy --------------------------------------------------------------------------------


@dataclass(frozen=True)
class OrgContext:
    """Who is calling, for which organization, with which role."""

    org: Organization
    role: Role
    token: ApiToken | None

    def allows(self, role: str) -> bool:
        return ROLE_RANK[self.role] >= ROLE_RANK[Role(role)]

    @property
    def job_scope(self) -> Any:
        """The job a job-scoped token (api_token well) may read, or None."""
        return self.token.job_id if self.token is not None else None


def org_context(request: Request) -> OrgContext:
    """Resolve (and cache on the request) the caller's org and role.

    Token: its org, with the member's role narrowed by the token's. Session (browsable API):
    the org named by ``X-Catacloud-Org`` or ``?org=``, else the user's only org.
    """
    cached = getattr(request, "_catacloud_ctx", None)
    if cached is not None:
        return cached
    token = request.auth if isinstance(request.auth, ApiToken) else None
    user = request.user
    if token is not None and hasattr(token, "member_role"):
        # Resolved by the bearer authentication's own query (the hot path: no second one).
        membership = (
            Membership(org=token.org, user=user, role=token.member_role) if token.member_role else None
        )
    elif token is not None:
        membership = Membership.objects.filter(org_id=token.org_id, user=user).select_related("org").first()
    else:
        slug = request.headers.get("X-Catacloud-Org") or request.query_params.get("org")
        memberships = Membership.objects.filter(user=user).select_related("org")
        if slug:
            memberships = memberships.filter(org__slug=slug)
        found = list(memberships[:2])
        membership = found[0] if len(found) == 1 else None
    if membership is None:
        raise exceptions.PermissionDenied(
            "you are not a member of an organization (name one with X-Catacloud-Org)"
        )
    role = Role(membership.role)
    if token is not None and token.role and ROLE_RANK[Role(token.role)] < ROLE_RANK[role]:
        role = Role(token.role)
    ctx = OrgContext(org=membership.org, role=role, token=token)
    request._catacloud_ctx = ctx
    return ctx


class RolePermission(permissions.BasePermission):
    """Checks the view's ``required_roles[action]`` (default: reads viewer, writes admin)."""

    message = "your role does not allow this"

    def has_permission(self, request: Request, view: APIView) -> bool:
        if not request.user or not request.user.is_authenticated:
            return False
        ctx = org_context(request)
        if ctx.job_scope is not None and not getattr(view, "job_scoped_access", False):
            return False
        needed = view.required_role(request)
        if not ctx.allows(needed):
            raise exceptions.PermissionDenied(f"this needs the {needed} role; you are {ctx.role}")
        return True


class OrgScopedViewSet(viewsets.GenericViewSet):
    """Base of every tenant viewset: querysets, lists and actions see only the caller's org."""

    permission_classes: ClassVar[list] = [RolePermission]
    org_field: ClassVar[str] = "org"
    # action -> minimum role; anything unlisted: safe methods need viewer, others admin.
    required_roles: ClassVar[dict[str, str]] = {}
    job_scoped_access: ClassVar[bool] = False

    def required_role(self, request: Request) -> str:
        if self.action in self.required_roles:
            return self.required_roles[self.action]
        return Role.VIEWER if request.method in permissions.SAFE_METHODS else Role.ADMIN

    @property
    def ctx(self) -> OrgContext:
        return org_context(self.request)

    def get_queryset(self) -> QuerySet:
        qs = super().get_queryset()
        if getattr(self, "swagger_fake_view", False):
            return qs.none()
        return qs.filter(**{self.org_field: self.ctx.org})

    # Set on views whose serializers tell whether the org holds a type's required privilege.
    needs_privileges: ClassVar[bool] = False

    def get_serializer_context(self) -> dict:
        """Serializers see the caller's org (to look up related objects only within it)."""
        context = super().get_serializer_context()
        if not getattr(self, "swagger_fake_view", False) and self.request.user.is_authenticated:
            context["org"] = self.ctx.org
            if self.needs_privileges:
                context["org_privileges"] = set(self.ctx.org.privileges.values_list("pk", flat=True))
        return context

    def actor(self) -> str:
        token = self.ctx.token
        who = self.request.user.get_username()
        return f"user:{who}" + (f" token:{token.prefix}" if token else "")
