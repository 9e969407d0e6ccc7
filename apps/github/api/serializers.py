from __future__ import annotations

from typing import Any

from rest_framework import serializers

from apps.ci.api import serializers as ci_serializers
from apps.ci.api.serializers import endpoint_health
from apps.github.choices import WorkflowJobStatus
from apps.github.models import GitHubConnection, RunnerClass, WorkflowJob
from apps.github.services import CLASS_FIELDS


class InstallationIn(serializers.Serializer):
    id = serializers.IntegerField(min_value=1)
    account = serializers.CharField(max_length=100, required=False, allow_blank=True, default="")


class ConnectionIn(serializers.Serializer):
    """Secrets are write-only: sent to set or replace them, never answered."""

    app_id = serializers.IntegerField(min_value=1, required=False)
    api_url = serializers.URLField(max_length=300, required=False)
    private_key = serializers.CharField(
        write_only=True, required=False, max_length=20000, trim_whitespace=False
    )
    webhook_secret = serializers.CharField(write_only=True, required=False, max_length=500)
    installations = InstallationIn(many=True, required=False)


class ConnectionOut(ci_serializers.ConnectionOut):
    forge_name = "github"
    private_key_set = ci_serializers.SecretSet(source="private_key")
    webhook_secret_set = ci_serializers.SecretSet(source="webhook_secret")
    webhook_url = serializers.SerializerMethodField(help_text="the Payload URL to give the GitHub App")
    installations = serializers.SerializerMethodField()

    class Meta:
        model = GitHubConnection
        fields = (
            "app_id",
            "api_url",
            "private_key_set",
            "webhook_secret_set",
            "webhook_url",
            "installations",
            "created_at",
            "updated_at",
        )

    def get_installations(self, obj: GitHubConnection) -> list[dict[str, Any]]:
        return [
            {"id": i.installation_id, "account": i.account, **endpoint_health(i)}
            for i in obj.installations.order_by("installation_id")
        ]


class RunnerClassSerializer(ci_serializers.RunnerClassSerializer):
    labels = serializers.ListField(child=serializers.CharField(max_length=100), min_length=1, max_length=100)
    queued = serializers.SerializerMethodField(help_text="workflow jobs of this class waiting for a runner")

    class Meta(ci_serializers.RunnerClassSerializer.Meta):
        model = RunnerClass
        fields = ("id", *CLASS_FIELDS, "job_config", "queued", "runners", "created_at", "updated_at")

    def get_queued(self, obj: RunnerClass) -> int:
        return obj.jobs.filter(status=WorkflowJobStatus.QUEUED).count()


class WorkflowJobSerializer(serializers.ModelSerializer):
    runner_class: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="name", read_only=True
    )
    installation = serializers.IntegerField(source="installation.installation_id", read_only=True)

    class Meta:
        model = WorkflowJob
        fields = (
            "id",
            "installation",
            "github_id",
            "run_id",
            "run_attempt",
            "repository",
            "workflow",
            "name",
            "labels",
            "status",
            "conclusion",
            "runner_class",
            "runner_name",
            "job",
            "seen_at",
            "status_changed_at",
            "started_at",
            "completed_at",
        )
        read_only_fields = fields
