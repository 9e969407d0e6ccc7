"""The GitHub Actions API: the org's connection (admins write it; its secrets are write-only),
runner classes, and the workflow jobs seen."""

from __future__ import annotations

import django_filters
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins

from apps.ci.api import views as ci_views
from apps.ci.api.views import ConnectionView
from apps.github.api.serializers import (
    ConnectionIn,
    ConnectionOut,
    RunnerClassSerializer,
    WorkflowJobSerializer,
)
from apps.github.choices import WorkflowJobStatus
from apps.github.models import GitHubConnection, RunnerClass, WorkflowJob
from apps.github.services import (
    CLASS_FIELDS,
    connection_delete,
    connection_set,
    runner_class_delete,
    runner_class_save,
)
from apps.orgs.api.base import OrgScopedViewSet


@extend_schema_view(
    get=extend_schema(responses={200: ConnectionOut}),
    put=extend_schema(request=ConnectionIn, responses={200: ConnectionOut, 201: ConnectionOut}),
    delete=extend_schema(responses={204: None}),
)
class GitHubConnectionView(ConnectionView):
    model = GitHubConnection
    title = "GitHub"
    serializer_in = ConnectionIn
    serializer_out = ConnectionOut
    children = "installations"
    connection_set = connection_set
    connection_delete = connection_delete


class RunnerClassViewSet(ci_views.RunnerClassViewSet):
    """Runner classes: which workflow jobs (by ``runs-on`` labels) run on which machine type."""

    queryset = RunnerClass.objects.select_related("machine_type", "pool")
    serializer_class = RunnerClassSerializer
    class_fields = CLASS_FIELDS
    class_save = runner_class_save
    class_delete = runner_class_delete


class WorkflowJobFilter(django_filters.FilterSet):
    status = django_filters.MultipleChoiceFilter(choices=WorkflowJobStatus.choices)
    runner_class = django_filters.CharFilter(field_name="runner_class__name")

    class Meta:
        model = WorkflowJob
        fields = ("status", "repository", "runner_class", "github_id")


class WorkflowJobViewSet(OrgScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """Workflow jobs one of the org's runner classes covers, as GitHub reported them, with the
    Catacloud job (runner) that ran each."""

    queryset = WorkflowJob.objects.select_related("runner_class", "installation")
    serializer_class = WorkflowJobSerializer
    filterset_class = WorkflowJobFilter
    ordering_fields = ("seen_at", "status_changed_at")
    ordering = ("-seen_at",)
