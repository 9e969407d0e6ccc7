from __future__ import annotations

from typing import Any

from rest_framework import serializers

from apps.core.api import StrictFields
from apps.jobs.models import Artifact, Job, JobConfiguration
from apps.machines.api.serializers import OrgMachineTypeField
from apps.machines.capacity import clean_requirements
from apps.orgs.api.base import org_context
from apps.orgs.choices import Role
from apps.resources.models import ResourceType


class EnvForMembersMixin(serializers.Serializer):
    """``env`` is shown to members and admins only: viewers and job-scoped tokens get ``{}``
    and ``env_hidden: true``."""

    env_hidden = serializers.SerializerMethodField(help_text="true when your role may not read env")

    def _env_hidden(self) -> bool:
        request = self.context.get("request")
        if request is None or not getattr(request.user, "is_authenticated", False):
            return True
        ctx = org_context(request)
        return ctx.job_scope is not None or not ctx.allows(Role.MEMBER)

    def get_env_hidden(self, obj: object) -> bool:
        return self._env_hidden()

    def to_representation(self, instance: object) -> dict:
        data = super().to_representation(instance)
        if data.get("env_hidden"):
            data["env"] = {}
        return data


SECRET_ENV_HELP = (
    "NAME: value pairs given to the job but never returned (stored encrypted); write-only: "
    "sending it replaces all of them, {} removes them"
)


def secret_env_field() -> serializers.DictField:
    return serializers.DictField(
        child=serializers.CharField(allow_blank=True, max_length=32768),
        required=False,
        write_only=True,
        help_text=SECRET_ENV_HELP,
    )


class JobConfigurationSerializer(StrictFields, EnvForMembersMixin, serializers.ModelSerializer):
    machine_type = OrgMachineTypeField(
        required=False,
        help_text="a machine type's name or id (one your organization has a grant for); with "
        "requirements: set for you, the cheapest type meeting them",
    )
    requirements = serializers.JSONField(
        required=False,
        help_text='what a job needs, e.g. {"cpus": 4, "memory_mb": 8192, "gpus": 0}: its jobs run on '
        "the cheapest granted machine type with at least that (and fall over to the next on a "
        "provider's capacity error); {} for none",
    )
    machine_type_name = serializers.CharField(source="machine_type.name", read_only=True)
    resources = serializers.SlugRelatedField(
        source="resource_types",
        slug_field="id",
        many=True,
        required=False,
        queryset=ResourceType.objects.all(),
        help_text="resource type ids the job acquires before it gets a machine",
    )
    env = serializers.DictField(
        child=serializers.CharField(allow_blank=True, max_length=32768), required=False
    )
    secret_env = secret_env_field()
    secret_env_keys = serializers.SerializerMethodField(help_text="names of the secret env values")
    image = serializers.CharField(
        max_length=512,
        required=False,
        allow_blank=True,
        help_text="a container image the command runs in: registry/repository:tag or "
        "registry/repository@sha256:<digest> (stored normalised); empty: the machine's own root",
    )
    timeout_seconds = serializers.IntegerField(min_value=1, max_value=7 * 86400, required=False)
    priority = serializers.IntegerField(min_value=-1000, max_value=1000, required=False)
    max_attempts = serializers.IntegerField(min_value=1, max_value=20, required=False)
    artifact_retention_days = serializers.IntegerField(min_value=0, max_value=3650, required=False)
    checkpoint_interval_seconds = serializers.IntegerField(
        min_value=10, max_value=86_400, required=False, allow_null=True
    )
    overflow_machine_type = OrgMachineTypeField(
        required=False,
        allow_null=True,
        help_text="a machine type (name or id) a job goes to when it waited overflow_after_seconds "
        "for a slot of an enrolled host type: owned capacity first, the cloud for the burst",
    )
    overflow_after_seconds = serializers.IntegerField(
        min_value=0, max_value=7 * 86400, required=False, allow_null=True
    )

    class Meta:
        model = JobConfiguration
        fields = (
            "id",
            "name",
            "machine_type",
            "machine_type_name",
            "command",
            "image",
            "env",
            "env_hidden",
            "secret_env",
            "secret_env_keys",
            "timeout_seconds",
            "resources",
            "priority",
            "max_attempts",
            "reuse",
            "artifact_retention_days",
            "checkpoint_interval_seconds",
            "overflow_machine_type",
            "overflow_after_seconds",
            "requirements",
            "created_at",
            "updated_at",
        )
        read_only_fields = ("id", "created_at", "updated_at")
        extra_kwargs = {"command": {"max_length": 65536, "trim_whitespace": False}}

    def get_secret_env_keys(self, obj: JobConfiguration) -> list[str]:
        return sorted(obj.secret_env)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        stated = clean_requirements(  # {"labels": {}} states nothing
            attrs["requirements"] if "requirements" in attrs else getattr(self.instance, "requirements", {})
        )
        if stated and "machine_type" in attrs:
            raise serializers.ValidationError(
                {
                    "machine_type": [
                        "leave it out with requirements: the cheapest type meeting them is chosen "
                        "(send requirements {} to name a machine type instead)"
                    ]
                }
            )
        if self.instance is None and "machine_type" not in attrs and not stated:
            raise serializers.ValidationError({"machine_type": ["this field is required (or requirements)"]})
        return super().validate(attrs)

    def validate_command(self, value: str) -> str:
        # An empty command is refused by job_config_save unless an image names the process.
        if "\x00" in value:
            raise serializers.ValidationError("must not contain NUL characters")
        return value


class JobSerializer(EnvForMembersMixin, serializers.ModelSerializer):
    secret_env_keys = serializers.SerializerMethodField(help_text="names of the secret env values")

    def get_secret_env_keys(self, obj: Job) -> list[str]:
        return sorted({*obj.config.secret_env, *obj.secret_env})

    config: serializers.PrimaryKeyRelatedField[Any] = serializers.PrimaryKeyRelatedField(read_only=True)
    config_name = serializers.CharField(source="config.name", read_only=True)
    machine_type: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="name", read_only=True
    )
    instance = serializers.UUIDField(source="instance_id", read_only=True, allow_null=True)

    class Meta:
        model = Job
        fields = (
            "id",
            "config",
            "config_name",
            "machine_type",
            "status",
            "pending_reason",
            "instance",
            "attempt",
            "max_attempts",
            "requeue_reason",
            "free_requeues",
            "priority",
            "exit_code",
            "failure_reason",
            "cancel_requested",
            "failure_code",
            "image",
            "image_digest",
            "env",
            "env_hidden",
            "secret_env_keys",
            "labels",
            "created_at",
            "queued_at",
            "admitted_at",
            "assigned_at",
            "started_at",
            "finished_at",
            "status_changed_at",
        )
        read_only_fields = fields


class JobSubmitSerializer(StrictFields):
    unknown_field_hints = {
        "machine_type": "a job runs on its configuration's machine type: submit a configuration "
        "that names the type you want (POST /job-configs/)",
        **{
            name: "set by the job's configuration"
            for name in ("command", "timeout_seconds", "priority", "max_attempts", "resources", "reuse")
        },
    }

    config = serializers.CharField(
        max_length=100,
        help_text="id or name of a job configuration of your organization (an unknown one answers 400 "
        "unknown_config)",
    )
    env = serializers.DictField(
        child=serializers.CharField(allow_blank=True, max_length=32768),
        required=False,
        help_text="added to (and overriding) the configuration's env",
    )
    secret_env = secret_env_field()
    image = serializers.CharField(
        max_length=512,
        required=False,
        help_text="run in this container image instead of the configuration's "
        "(registry/repository:tag or …@sha256:<digest>)",
    )


class LogChunkSerializer(serializers.Serializer):
    attempt = serializers.IntegerField()
    seq = serializers.IntegerField()
    stream = serializers.CharField()
    data = serializers.CharField()  # type: ignore[assignment]  # the chunk's text, not Serializer.data


# What the log columns (PostgreSQL integer) can hold: a cursor beyond it is refused, not sent.
PG_INT_MAX = 2**31 - 1


class JobLogsQuerySerializer(serializers.Serializer):
    """``GET /jobs/{id}/logs/`` parameters."""

    after = serializers.IntegerField(min_value=-1, max_value=PG_INT_MAX, default=-1)
    attempt = serializers.IntegerField(min_value=1, max_value=PG_INT_MAX, required=False)


class JobLogsSerializer(serializers.Serializer):
    job = serializers.UUIDField()
    status = serializers.CharField()
    attempt = serializers.IntegerField()
    text = serializers.CharField(help_text="stdout and stderr of this attempt, in order")
    chunks = LogChunkSerializer(many=True)
    next_after = serializers.IntegerField(help_text="pass as ?after= to get only newer output")


class ArtifactSerializer(serializers.ModelSerializer):
    class Meta:
        model = Artifact
        fields = ("name", "kind", "size", "sha256", "status", "error", "attempt", "created_at", "expires_at")
        read_only_fields = fields
