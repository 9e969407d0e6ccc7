from __future__ import annotations

import django_filters
from django.db.models import Count, Q, QuerySet
from rest_framework import mixins

from apps.orgs.api.base import OrgScopedFilterSet, OrgScopedViewSet
from apps.resources.api.serializers import ResourceSerializer, ResourceTypeSerializer
from apps.resources.choices import RESOURCE_LIVE, ResourceStatus
from apps.resources.models import ResourceInstance, ResourceType


class ResourceTypeViewSet(OrgScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """The wells' resource types (installation-wide), with how many are in use."""

    queryset = ResourceType.objects.all()
    serializer_class = ResourceTypeSerializer
    filterset_fields = ("well",)
    ordering_fields = ("id",)
    ordering = ("id",)

    def get_queryset(self) -> QuerySet[ResourceType]:
        return ResourceType.objects.select_related("required_privilege").annotate(
            in_use=Count("instances", filter=Q(instances__status__in=RESOURCE_LIVE))
        )

    needs_privileges = True


class ResourceFilter(OrgScopedFilterSet):
    status = django_filters.MultipleChoiceFilter(choices=ResourceStatus.choices)
    resource_type = django_filters.CharFilter(field_name="resource_type_id")
    job = django_filters.UUIDFilter(field_name="job_id")

    class Meta:
        model = ResourceInstance
        fields = ("status", "resource_type", "job")


class ResourceViewSet(OrgScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """Your organization's resource instances and their state."""

    queryset = ResourceInstance.objects.select_related("resource_type")
    serializer_class = ResourceSerializer
    filterset_class = ResourceFilter
    ordering_fields = ("created_at", "status")
    ordering = ("-created_at",)
