"""Boundary: a job's scratch database role reaches its own database only.

Shown on main: a scratch role could CONNECT to the control-plane database (``PUBLIC`` kept
CONNECT) and to the other jobs' scratch databases.
"""

from __future__ import annotations

import psycopg
import pytest
from django.db import connection
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from apps.jobs.acquisition import job_acquire_resources
from apps.jobs.models import Job
from apps.resources.models import ResourceInstance, ResourceType
from tests.conftest import World
from tests.resources.test_resources import admitted_job, config_with, release


def scratch_database(world: World, name: str) -> tuple[Job, ResourceInstance]:
    job = admitted_job(world, config_with(world, "scratch-db", name=name))
    assert job_acquire_resources(job_id=job.pk) == "done"
    return job, ResourceInstance.objects.get(job=job)


@pytest.mark.django_db(transaction=True)
def test_a_scratch_role_cannot_connect_to_the_control_plane_or_another_scratch_db(tworld: World) -> None:
    ResourceType.objects.create(
        id="scratch-db", well="postgres_database", config={"use_catacloud_database": True}
    )
    job_a, mine = scratch_database(tworld, "a")
    job_b, theirs = scratch_database(tworld, "b")
    try:
        dsn = conninfo_to_dict(mine.secret["dsn"])
        with psycopg.connect(mine.secret["dsn"]) as conn:  # its own database: fine
            assert conn.execute("SELECT 1").fetchone() == (1,)
        for target in (connection.settings_dict["NAME"], theirs.metadata["dbname"]):
            with pytest.raises(psycopg.OperationalError, match="permission denied"):
                psycopg.connect(make_conninfo(**{**dsn, "dbname": target})).close()
    finally:
        release(job_a)
        release(job_b)
