"""The handed-off rule has one home (apps/jobs/handoff.py) and three forms: the ORM's (the
agent's poll through Django), Python's (a locked row) and SQL's (the agent server's prepared
statement). They agree on every case."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection

from apps.jobs.handoff import HANDED_OFF_SQL, handed_off, is_handed_off
from apps.jobs.models import Job
from tests.conftest import World

pytestmark = pytest.mark.django_db


def test_the_orm_python_and_sql_forms_of_handed_off_agree(world: World) -> None:
    from testkit.builders import instance_row, job_config

    config = job_config(world.org, world.machine_type, name="h")
    machine = instance_row(world.org, world.machine_type, status="claimed")
    other = uuid.uuid4()
    cases = {  # (handoff_by, handed_off_to) on a job assigned to `machine`
        "no handoff": ("", None),
        "awaiting": ("github", None),
        "handed to its machine": ("github", machine.pk),
        "handed to another machine": ("github", other),
    }
    jobs = {
        name: Job.objects.create(
            org=world.org,
            config=config,
            machine_type=world.machine_type,
            command="true",
            status="assigned",
            instance=machine,
            handoff_by=by,
            handed_off_to=to,
        )
        for name, (by, to) in cases.items()
    }
    orm = set(
        Job.objects.filter(handed_off(), pk__in=[j.pk for j in jobs.values()]).values_list("pk", flat=True)
    )
    python = {j.pk for j in jobs.values() if is_handed_off(j)}
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT id FROM {Job._meta.db_table} WHERE id = ANY(%s) AND {HANDED_OFF_SQL}",
            [list(orm | python | {j.pk for j in jobs.values()})],
        )
        sql = {row[0] for row in cursor.fetchall()}
    assert orm == python == sql == {jobs["no handoff"].pk, jobs["handed to its machine"].pk}
