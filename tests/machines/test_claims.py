"""The claim statement writes its event by hand (one round trip); it must stay the Event model's row."""

from __future__ import annotations

from apps.events.models import Event
from apps.machines import claims


def test_the_claim_event_insert_names_every_event_column() -> None:
    written = {name for name, _ in claims.EVENT_VALUES}
    columns = {f.name for f in Event._meta.concrete_fields if not f.primary_key}
    assert written == columns  # a field added to Event must be written by the claim too
