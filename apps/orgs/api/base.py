"""The base of every tenant API view: the caller's org and role (OrgContext), role checks,
org-scoped querysets and filters. Errors and the exception handler are in apps.core.api."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

import django_filters
from django.db.models import QuerySet, UUIDField
from django.http import Http404
from rest_framework import exceptions, mixins, permissions, viewsets
from rest_framework.request import Request
from rest_framework.views import APIView

from apps.core.actors import Actor
from apps.core.errors import NotFound
from apps.orgs.choices import ROLE_RANK, Role
from apps.orgs.models import ApiToken, Membership, Organization

JOB_SCOPE = "job:"  # ApiToken.scope of a job-scoped token (apps.resources.wells.api_token)


class OrgScopedFilterSet(django_filters.FilterSet):
    """Filters that name other objects (``?instance=<id>``) choose only among the caller's org's:
    another org's id is refused exactly like an id that does not exist, so a filter never tells
    whether another tenant's object exists."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        request = self.request
        if request is None or not getattr(request, "user", None) or not request.user.is_authenticated:
            return
        org = org_context(request).org
        for field in self.form.fields.values():
            queryset = getattr(field, "queryset", None)
            if queryset is None:
                continue
            names = {f.name for f in queryset.model._meta.get_fields()}
            if "org" in names:
                field.queryset = queryset.filter(org=org)
            elif "orgs" in names:
                field.queryset = queryset.filter(orgs=org)


class IdPrefixFilter(django_filters.CharFilter):
    """``?id_prefix=bd3d252e``: the rows whose id starts with these hex digits (the short ids
    the console and the CLI show, like git's abbreviated hashes). A range on the primary key,
    so its index answers it: ``id BETWEEN bd3d252e-0000-… AND bd3d252e-ffff-…``."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("help_text", "ids starting with these hex digits (a short id)")
        super().__init__(**kwargs)

    def filter(self, qs: QuerySet, value: str) -> QuerySet:
        if not value:
            return qs
        digits = value.replace("-", "").lower()
        if len(digits) > 32 or any(c not in "0123456789abcdef" for c in digits):
            raise exceptions.ValidationError({"id_prefix": ["the first hex digits of an id, e.g. bd3d252e"]})
        low, high = uuid.UUID(digits.ljust(32, "0")), uuid.UUID(digits.ljust(32, "f"))
        return qs.filter(pk__gte=low, pk__lte=high)


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
        if self.token is None or not self.token.scope.startswith(JOB_SCOPE):
            return None
        return self.token.scope.removeprefix(JOB_SCOPE)


def org_context(request: Request) -> OrgContext:
    """Resolve (and cache on the request) the caller's org and role.

    Token: its org, with the member's role narrowed by the token's. Session (browsable API):
    the org named by ``X-Catacloud-Org`` or ``?org=``, else the user's only org.
    """
    cached = getattr(request, "_catacloud_ctx", None)
    if cached is not None:
        return cached
    token = request.auth if isinstance(request.auth, ApiToken) else None
    user: Any = request.user  # authenticated: RolePermission checked it
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
    request._catacloud_ctx = ctx  # type: ignore[attr-defined]
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
        needed = view.required_role(request)  # type: ignore[attr-defined]  # an OrgScopedViewSet
        if not ctx.allows(needed):
            raise exceptions.PermissionDenied(f"this needs the {needed} role; you are {ctx.role}")
        return True


class OrgScopedViewSet(viewsets.GenericViewSet):
    """Base of every tenant viewset: querysets, lists and actions see only the caller's org."""

    permission_classes = [RolePermission]
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

    def get_serializer_context(self) -> dict[str, Any]:
        """Serializers see the caller's org (to look up related objects only within it)."""
        context = dict(super().get_serializer_context())
        if not getattr(self, "swagger_fake_view", False) and self.request.user.is_authenticated:
            context["org"] = self.ctx.org
            if self.needs_privileges:
                context["org_privileges"] = set(self.ctx.org.privileges.values_list("pk", flat=True))
        return context

    def get_object(self) -> Any:
        try:
            return super().get_object()
        except Http404:
            raise NotFound(self._not_found()) from None

    def _not_found(self) -> str:
        """A 404 that says what the path's id should be: ``/jobs/bd3d252e/`` names the job whose
        id starts with it (the API takes a full id; the CLI and the console show short ones).
        Another org's object is looked for exactly like a missing one: never found."""
        model = self.get_queryset().model
        noun = str(model._meta.verbose_name)
        ref = str(self.kwargs.get(self.lookup_url_kwarg or self.lookup_field, ""))
        if self.lookup_field != "pk" or not isinstance(model._meta.pk, UUIDField):
            return f"no {noun} {ref!r}"
        try:
            return f"no {noun} with id {uuid.UUID(ref)}"
        except ValueError:
            pass
        digits = ref.replace("-", "").lower()
        if not digits or len(digits) > 32 or any(c not in "0123456789abcdef" for c in digits):
            return f"{ref!r} is not a {noun} id: the API takes a {noun}'s full id (a UUID)"
        low, high = uuid.UUID(digits.ljust(32, "0")), uuid.UUID(digits.ljust(32, "f"))
        found = list(self.get_queryset().filter(pk__gte=low, pk__lte=high).values_list("pk", flat=True)[:2])
        if not found:
            return f"no {noun}'s id starts with {ref} (the API takes a {noun}'s full id)"
        if len(found) > 1:
            return f"the API takes a {noun}'s full id, not its first digits: {ref} is the start of several"
        return (
            f"the API takes a {noun}'s full id, not its first digits: {ref} is the start of {found[0]} "
            f"({self.request.method} {self.request.path.replace(ref, str(found[0]), 1)})"
        )

    def actor(self) -> Actor:
        token = self.ctx.token
        return Actor.user(self.request.user.get_username(), token.prefix if token else None)


class OrgScopedModelViewSet(
    OrgScopedViewSet,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.UpdateModelMixin,
    mixins.DestroyModelMixin,
):
    """An org's objects listed, read, created, changed and deleted (DRF's ``ModelViewSet``,
    scoped to the caller's org)."""
