"""The GitLab CI API: the org's connection (admins write it; its token and secret token are
write-only), runner classes, and the CI jobs seen."""

from __future__ import annotations

import django_filters
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins

from apps.ci.api import views as ci_views
from apps.ci.api.views import ConnectionView
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
from apps.orgs.api.base import OrgScopedViewSet


@extend_schema_view(
    get=extend_schema(responses={200: GitLabConnectionOut}),
    put=extend_schema(
        request=GitLabConnectionIn, responses={200: GitLabConnectionOut, 201: GitLabConnectionOut}
    ),
    delete=extend_schema(responses={204: None}),
)
class GitLabConnectionView(ConnectionView):
    model = GitLabConnection
    title = "GitLab"
    serializer_in = GitLabConnectionIn
    serializer_out = GitLabConnectionOut
    children = "projects"
    connection_set = connection_set
    connection_delete = connection_delete


class RunnerClassViewSet(ci_views.RunnerClassViewSet):
    """Runner classes: which CI jobs (by ``tags``) run on which machine type."""

    queryset = GitLabRunnerClass.objects.select_related("machine_type", "pool")
    serializer_class = GitLabRunnerClassSerializer
    class_fields = CLASS_FIELDS
    class_save = runner_class_save
    class_delete = runner_class_delete


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
