from __future__ import annotations

from rest_framework import serializers

from apps.events.models import Event


class EventSerializer(serializers.ModelSerializer):
    class Meta:
        model = Event
        fields = ("id", "kind", "created_at", "actor", "reason", "pool_id", "instance_id", "job_id", "data")
        read_only_fields = fields
