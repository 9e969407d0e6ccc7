"""Boundary: the embedded PostgreSQL is not open to anyone on the machine.

Shown on main: it ran with trust authentication, so any local process (a job on the local
provider included) connected as superuser with no password.
"""

from __future__ import annotations

import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from django.db import connection

from catacloud.embedded import EmbeddedPostgres


def no_password_dsn(port: int, db: str = "postgres") -> str:
    return f"postgresql://postgres@127.0.0.1:{port}/{db}"


@pytest.mark.django_db
def test_the_running_embedded_server_needs_its_password() -> None:
    port = int(connection.settings_dict["PORT"])
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(no_password_dsn(port), connect_timeout=5).close()


@pytest.fixture
def home() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="catacloud-pg-test-"))
    path.chmod(0o755)  # the server runs as its own system user when we are root
    yield path
    EmbeddedPostgres(path).stop()
    shutil.rmtree(path, ignore_errors=True)


def test_an_old_trust_cluster_gets_a_password_at_its_next_start(home: Path) -> None:
    pg = EmbeddedPostgres(home)
    pg.start()  # initdb --auth=trust, as every home made before passwords existed
    port = pg.state.load()["port"]
    psycopg.connect(no_password_dsn(port)).close()  # the old, open state

    pg.secure()

    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(no_password_dsn(port), connect_timeout=5).close()
    with psycopg.connect(pg.url("postgres")) as conn:
        assert conn.execute("SELECT current_user").fetchone() == ("postgres",)
    assert stat.S_IMODE((home / "pg-password").stat().st_mode) == 0o600
    pg.secure()  # idempotent: a restart changes nothing and still connects
    psycopg.connect(pg.url("postgres")).close()
