"""Only the database's owner (the control plane's role) and superusers may connect to the
control-plane database: a scratch database role (the postgres_database well) created on the
same server must not. A role that does not own the database gets a warning, not an error."""

from __future__ import annotations

from django.db import migrations

REVOKE = """
DO $$
BEGIN
    EXECUTE format('REVOKE CONNECT ON DATABASE %I FROM PUBLIC', current_database());
END
$$;
"""
GRANT = """
DO $$
BEGIN
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO PUBLIC', current_database());
END
$$;
"""


class Migration(migrations.Migration):
    dependencies = [("core", "0001_initial")]

    operations = [migrations.RunSQL(REVOKE, reverse_sql=GRANT)]
