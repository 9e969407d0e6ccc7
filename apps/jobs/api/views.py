from __future__ import annotations

import django_filters
from rest_framework import mixins
from rest_framework.serializers import BaseSerializer

from apps.core.api import OrgScopedViewSet
from apps.jobs.api.serializers import JobConfigurationSerializer
from apps.jobs.models import JobConfiguration
from apps.jobs.services import job_config_delete, job_config_save


class JobConfigurationFilter(django_filters.FilterSet):
    machine_type = django_filters.CharFilter(field_name="machine_type__name")

    class Meta:
        model = JobConfiguration
        fields = ("name", "machine_type", "reuse")


class JobConfigurationViewSet(
    OrgScopedViewSet,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.UpdateModelMixin,
    mixins.DestroyModelMixin,
):
    """Named recipes for jobs. Viewers read; admins create, change and delete."""

    queryset = JobConfiguration.objects.select_related("machine_type").prefetch_related("resource_types")
    serializer_class = JobConfigurationSerializer
    filterset_class = JobConfigurationFilter
    ordering_fields = ("name", "priority", "created_at")
    ordering = ("name",)

    def get_serializer_context(self) -> dict:
        context = super().get_serializer_context()
        if not getattr(self, "swagger_fake_view", False) and self.request.user.is_authenticated:
            context["org"] = self.ctx.org
        return context

    def perform_create(self, serializer: BaseSerializer) -> None:
        data = dict(serializer.validated_data)
        resource_types = data.pop("resource_types", [])
        serializer.instance = job_config_save(
            org=self.ctx.org, actor=self.actor(), resource_types=resource_types, **data
        )

    def perform_update(self, serializer: BaseSerializer) -> None:
        data = dict(serializer.validated_data)
        resource_types = data.pop("resource_types", None)
        serializer.instance = job_config_save(
            org=self.ctx.org,
            config=serializer.instance,
            actor=self.actor(),
            resource_types=resource_types,
            **data,
        )

    def perform_destroy(self, instance: JobConfiguration) -> None:
        job_config_delete(config=instance, actor=self.actor())
