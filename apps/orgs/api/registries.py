"""``/registry-credentials/``: an organization's credentials for private container registries.
Viewers read the host and user name; admins set and remove them; the password is write-only."""

from __future__ import annotations

from rest_framework import serializers
from rest_framework.serializers import BaseSerializer

from apps.core.api import StrictFields
from apps.core.errors import ValidationFailed
from apps.orgs.api.base import OrgScopedModelViewSet
from apps.orgs.models import RegistryCredential
from apps.orgs.registries import registry_credential_delete, registry_credential_set


class RegistryCredentialSerializer(StrictFields, serializers.ModelSerializer):
    registry = serializers.CharField(
        max_length=255, help_text="host or host:port, as image references name it (docker.io for Docker Hub)"
    )
    username = serializers.CharField(max_length=255)
    password = serializers.CharField(
        max_length=8192,
        write_only=True,
        trim_whitespace=False,
        help_text="write-only: stored encrypted, used by the agent that pulls, never returned",
    )

    class Meta:
        model = RegistryCredential
        fields = ("id", "registry", "username", "password", "created_at", "updated_at")
        read_only_fields = ("id", "created_at", "updated_at")


class RegistryCredentialViewSet(OrgScopedModelViewSet):
    """Credentials per registry host. ``POST`` sets them (replacing the host's earlier ones)."""

    queryset = RegistryCredential.objects.all()
    serializer_class = RegistryCredentialSerializer
    ordering = ("registry",)

    def perform_create(self, serializer: BaseSerializer) -> None:
        serializer.instance = registry_credential_set(
            org=self.ctx.org, actor=self.actor(), **serializer.validated_data
        )

    def perform_update(self, serializer: BaseSerializer) -> None:
        current = serializer.instance
        assert isinstance(current, RegistryCredential)
        if (
            "registry" in serializer.validated_data
            and serializer.validated_data["registry"] != current.registry
        ):
            raise ValidationFailed.field("registry", "cannot change: delete these and set the new host's")
        data = {"registry": current.registry, **serializer.validated_data}
        if "password" not in data:
            data["password"] = current.password
        serializer.instance = registry_credential_set(org=self.ctx.org, actor=self.actor(), **data)

    def perform_destroy(self, instance: RegistryCredential) -> None:
        registry_credential_delete(credential=instance, actor=self.actor())
