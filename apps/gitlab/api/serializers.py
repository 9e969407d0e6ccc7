from __future__ import annotations

from typing import Any

from rest_framework import serializers

from apps.ci.api import serializers as ci_serializers
from apps.ci.api.serializers import endpoint_health
from apps.gitlab.choices import GitLabJobStatus
from apps.gitlab.models import GitLabConnection, GitLabJob, GitLabRunnerClass
from apps.gitlab.services import CLASS_FIELDS


class ProjectIn(serializers.Serializer):
    id = serializers.IntegerField(min_value=1)
    path = serializers.CharField(max_length=300)


class GitLabConnectionIn(serializers.Serializer):
    """Secrets are write-only: sent to set or replace them, never answered."""

    url = serializers.URLField(max_length=300, required=False)
    token = serializers.CharField(write_only=True, required=False, max_length=500)
    webhook_token = serializers.CharField(write_only=True, required=False, max_length=500)
    projects = ProjectIn(many=True, required=False)


class GitLabConnectionOut(ci_serializers.ConnectionOut):
    forge_name = "gitlab"
    token_set = ci_serializers.SecretSet(source="token")
    webhook_token_set = ci_serializers.SecretSet(source="webhook_token")
    webhook_url = serializers.SerializerMethodField(help_text="the webhook URL to give GitLab (Job events)")
    projects = serializers.SerializerMethodField()
    health = serializers.SerializerMethodField()

    class Meta:
        model = GitLabConnection
        fields = (
            "url",
            "token_set",
            "webhook_token_set",
            "webhook_url",
            "projects",
            "health",
            "created_at",
            "updated_at",
        )

    def get_projects(self, obj: GitLabConnection) -> list[dict[str, Any]]:
        return [{"id": p.project_id, "path": p.path} for p in obj.projects.order_by("path")]

    def get_health(self, obj: GitLabConnection) -> dict[str, Any]:
        return endpoint_health(obj)


class GitLabRunnerClassSerializer(ci_serializers.RunnerClassSerializer):
    tags = serializers.ListField(child=serializers.CharField(max_length=255), min_length=1, max_length=100)
    pending = serializers.SerializerMethodField(help_text="CI jobs of this class waiting for a runner")

    class Meta(ci_serializers.RunnerClassSerializer.Meta):
        model = GitLabRunnerClass
        fields = ("id", *CLASS_FIELDS, "job_config", "pending", "runners", "created_at", "updated_at")

    def get_pending(self, obj: GitLabRunnerClass) -> int:
        return obj.jobs.filter(status=GitLabJobStatus.PENDING).count()


class GitLabJobSerializer(serializers.ModelSerializer):
    runner_class: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="name", read_only=True
    )

    class Meta:
        model = GitLabJob
        fields = (
            "id",
            "gitlab_id",
            "project_id",
            "project",
            "pipeline_id",
            "pipeline",
            "ref",
            "name",
            "stage",
            "tags",
            "status",
            "conclusion",
            "failure_reason",
            "runner_class",
            "runner_name",
            "job",
            "seen_at",
            "status_changed_at",
            "started_at",
            "completed_at",
        )
        read_only_fields = fields
