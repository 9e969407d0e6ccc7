"""The event feed: every app writes events (apps.events, a low layer); reading them is a tenant
API, so it lives above orgs."""

from __future__ import annotations

import django_filters
from rest_framework import mixins

from apps.control.api.serializers import EventSerializer
from apps.events.models import Event
from apps.orgs.api.base import OrgScopedFilterSet, OrgScopedViewSet


class EventFilter(OrgScopedFilterSet):
    kind_prefix = django_filters.CharFilter(
        field_name="kind", lookup_expr="startswith", help_text="e.g. pool"
    )
    since = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="gte")

    class Meta:
        model = Event
        fields = ("kind", "kind_prefix", "pool_id", "instance_id", "job_id", "since")


class EventViewSet(OrgScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """What happened, newest first. ``?kind_prefix=pool&limit=50``."""

    queryset = Event.objects.all()
    serializer_class = EventSerializer
    filterset_class = EventFilter
    ordering_fields = ("id", "created_at")
    ordering = ("-id",)
    job_scoped_access = True  # a job's own token (api_token well) reads that job's events

    def get_queryset(self):
        qs = super().get_queryset()
        if not getattr(self, "swagger_fake_view", False) and self.ctx.job_scope is not None:
            qs = qs.filter(job_id=self.ctx.job_scope)
        return qs
