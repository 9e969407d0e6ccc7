"""The event log: an event names its org, pool, instance and job by row or by id, keeps the rest
as data, and a state machine's bulk move records its events in one statement."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from apps.core.transitions import NewEvent
from apps.events.kinds import EventKind
from apps.events.models import Event
from apps.events.services import event_record, events_record
from testkit.builders import instance_row
from tests.conftest import World

pytestmark = pytest.mark.django_db


def test_an_event_names_rows_by_row_or_by_id_and_keeps_the_rest_as_data(world: World) -> None:
    instance = instance_row(world.org, world.machine_type, status="ready")
    by_row = event_record(kind=EventKind.INSTANCE_READY, org=world.org, instance=instance, actor="a", size=3)
    by_id = event_record(
        kind=EventKind.INSTANCE_READY, org=world.org.pk, instance=instance.pk, actor="a", size=3
    )
    for event in (by_row, by_id):
        event.refresh_from_db()
        assert (event.org_id, event.instance_id, event.pool_id, event.job_id) == (
            world.org.pk,
            instance.pk,
            None,
            None,
        )
        assert event.data == {"size": 3}


def test_a_bulk_of_events_is_one_statement(world: World) -> None:
    instances = [instance_row(world.org, world.machine_type, status="ready") for _ in range(3)]
    with CaptureQueriesContext(connection) as queries:
        events_record(
            [
                NewEvent(
                    kind=EventKind.INSTANCE_CLAIMED,
                    actor="x",
                    refs={"org": world.org.pk, "instance": i.pk, "n": n},
                )
                for n, i in enumerate(instances)
            ]
        )
    assert len(queries.captured_queries) == 1
    rows = list(Event.objects.filter(kind="instance.claimed").order_by("id"))
    assert [(e.instance_id, e.data) for e in rows] == [(i.pk, {"n": n}) for n, i in enumerate(instances)]
