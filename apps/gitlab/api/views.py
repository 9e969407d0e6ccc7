"""The GitLab CI API: the org's connection (admins write it; its token and secret token are
write-only), runner classes, and the CI jobs seen."""

from __future__ import annotations

from typing import Any

import django_filters
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.actors import Actor
from apps.core.errors import NotFound
from apps.gitlab.api.serializers import (
    GitLabConnectionIn,
    GitLabConnectionOut,
    GitLabJobSerializer,
    GitLabRunnerClassSerializer,
)
from apps.gitlab.choices import GitLabJobStatus
from apps.gitlab.models import GitLabConnection, GitLabJob, GitLabRunnerClass
from apps.gitlab.services import (
    CLASS_FIELDS,
    connection_delete,
    connection_set,
    runner_class_delete,
    runner_class_save,
)
from apps.orgs.api.base import OrgScopedViewSet, RolePermission, org_context
from apps.orgs.choices import Role


class GitLabConnectionView(APIView):
    """``GET`` (viewer): the connection with its secrets masked (``*_set``); ``PUT`` (admin):
    create or change it; ``DELETE`` (admin): remove it (409 while runners live)."""

    permission_classes = [RolePermission]

    def required_role(self, request: Request) -> str:
        return Role.VIEWER if request.method in ("GET", "HEAD", "OPTIONS") else Role.ADMIN

    def _actor(self, request: Request) -> Actor:
        return Actor.user(request.user.get_username())

    @extend_schema(responses={200: GitLabConnectionOut})
    def get(self, request: Request) -> Response:
        conn = GitLabConnection.objects.filter(org=org_context(request).org).first()
        if conn is None:
            raise NotFound("this organization has no GitLab connection")
        return Response(GitLabConnectionOut(conn).data)

    @extend_schema(request=GitLabConnectionIn, responses={200: GitLabConnectionOut, 201: GitLabConnectionOut})
    def put(self, request: Request) -> Response:
        body = GitLabConnectionIn(data=request.data)
        body.is_valid(raise_exception=True)
        data: dict[str, Any] = dict(body.validated_data)
        if "projects" in data:
            data["projects"] = [dict(p) for p in data["projects"]]
        org = org_context(request).org
        existed = GitLabConnection.objects.filter(org=org).exists()
        conn, _ = connection_set(org=org, actor=self._actor(request), **data)
        return Response(
            GitLabConnectionOut(conn).data, status=status.HTTP_200_OK if existed else status.HTTP_201_CREATED
        )

    @extend_schema(responses={204: None})
    def delete(self, request: Request) -> Response:
        connection_delete(org=org_context(request).org, actor=self._actor(request))
        return Response(status=status.HTTP_204_NO_CONTENT)


class RunnerClassViewSet(
    OrgScopedViewSet,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.UpdateModelMixin,
    mixins.DestroyModelMixin,
):
    """Runner classes: which CI jobs (by ``tags``) run on which machine type."""

    queryset = GitLabRunnerClass.objects.select_related("machine_type", "pool")
    serializer_class = GitLabRunnerClassSerializer
    ordering = ("name",)
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def perform_create(self, serializer: Any) -> None:
        fields = {k: v for k, v in serializer.validated_data.items() if k in CLASS_FIELDS}
        serializer.instance, _ = runner_class_save(org=self.ctx.org, actor=self.actor(), **fields)

    def perform_update(self, serializer: Any) -> None:
        fields = {k: v for k, v in serializer.validated_data.items() if k in CLASS_FIELDS}
        serializer.instance, _ = runner_class_save(
            org=self.ctx.org, runner_class=serializer.instance, actor=self.actor(), **fields
        )

    def perform_destroy(self, instance: GitLabRunnerClass) -> None:
        runner_class_delete(runner_class=instance, actor=self.actor())


class GitLabJobFilter(django_filters.FilterSet):
    status = django_filters.MultipleChoiceFilter(choices=GitLabJobStatus.choices)
    runner_class = django_filters.CharFilter(field_name="runner_class__name")

    class Meta:
        model = GitLabJob
        fields = ("status", "project", "runner_class", "gitlab_id", "pipeline_id")


class GitLabJobViewSet(OrgScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """CI jobs one of the org's runner classes covers, as GitLab reported them, with the
    Catacloud job (runner) that ran each."""

    queryset = GitLabJob.objects.select_related("runner_class")
    serializer_class = GitLabJobSerializer
    filterset_class = GitLabJobFilter
    ordering_fields = ("seen_at", "status_changed_at")
    ordering = ("-seen_at",)
