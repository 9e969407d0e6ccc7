"""What every forge's API does the same way: the org's connection (``GET`` for viewers, ``PUT``
and ``DELETE`` for admins; its secrets write-only) and runner classes saved through the
forge's services. An adapter's views set the model, serializers and services; its schema names
come from its own serializers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from django.db import models
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.actors import Actor
from apps.core.errors import NotFound
from apps.orgs.api.base import OrgScopedModelViewSet, RolePermission, org_context
from apps.orgs.choices import Role


class ConnectionView(APIView):
    """``GET`` (viewer): the connection with its secrets masked (``*_set``); ``PUT`` (admin):
    create or change it; ``DELETE`` (admin): remove it (409 while runners live)."""

    permission_classes = [RolePermission]
    model: ClassVar[type[models.Model]]
    title: ClassVar[str]  # "GitHub", "GitLab"
    serializer_in: ClassVar[type[serializers.Serializer]]
    serializer_out: ClassVar[type[serializers.Serializer]]
    children: ClassVar[str]  # the list of the connection's children it takes: installations, projects
    connection_set: ClassVar[Callable[..., tuple[Any, bool]]]
    connection_delete: ClassVar[Callable[..., None]]

    def required_role(self, request: Request) -> str:
        return Role.VIEWER if request.method in ("GET", "HEAD", "OPTIONS") else Role.ADMIN

    def _actor(self, request: Request) -> Actor:
        return Actor.user(request.user.get_username())

    def get(self, request: Request) -> Response:
        conn = self.model._default_manager.filter(org=org_context(request).org).first()
        if conn is None:
            raise NotFound(f"this organization has no {self.title} connection")
        return Response(self.serializer_out(conn).data)

    def put(self, request: Request) -> Response:
        body = self.serializer_in(data=request.data)
        body.is_valid(raise_exception=True)
        data: dict[str, Any] = dict(body.validated_data)
        if self.children in data:
            data[self.children] = [dict(c) for c in data[self.children]]
        org = org_context(request).org
        existed = self.model._default_manager.filter(org=org).exists()
        conn, _ = type(self).connection_set(org=org, actor=self._actor(request), **data)
        return Response(
            self.serializer_out(conn).data, status=status.HTTP_200_OK if existed else status.HTTP_201_CREATED
        )

    def delete(self, request: Request) -> Response:
        type(self).connection_delete(org=org_context(request).org, actor=self._actor(request))
        return Response(status=status.HTTP_204_NO_CONTENT)


class RunnerClassViewSet(OrgScopedModelViewSet):
    """Runner classes: which CI jobs (by labels or tags) run on which machine type."""

    ordering = ("name",)
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]
    class_fields: ClassVar[tuple[str, ...]]
    class_save: ClassVar[Callable[..., tuple[Any, bool]]]
    class_delete: ClassVar[Callable[..., None]]

    def _fields(self, serializer: Any) -> dict[str, Any]:
        return {k: v for k, v in serializer.validated_data.items() if k in self.class_fields}

    def perform_create(self, serializer: Any) -> None:
        serializer.instance, _ = type(self).class_save(
            org=self.ctx.org, actor=self.actor(), **self._fields(serializer)
        )

    def perform_update(self, serializer: Any) -> None:
        serializer.instance, _ = type(self).class_save(
            org=self.ctx.org, runner_class=serializer.instance, actor=self.actor(), **self._fields(serializer)
        )

    def perform_destroy(self, instance: Any) -> None:
        type(self).class_delete(runner_class=instance, actor=self.actor())
