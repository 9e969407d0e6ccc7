"""The events' organization key loses its own index: ``event_org_newest`` (org_id, id DESC)
leads with the same column and serves every lookup by organization (the events API, an
organization's delete), while every event written (one per claim) paid for both. Dropped
CONCURRENTLY: writers are never locked out on a large events table."""

import django.db.models.deletion
from django.db import migrations, models

INDEX = "events_event_org_id_3cdda316"  # Django's name for the key's index


class Migration(migrations.Migration):
    atomic = False  # DROP INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("events", "0002_initial")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    f'DROP INDEX CONCURRENTLY IF EXISTS "{INDEX}"',
                    reverse_sql=f'CREATE INDEX CONCURRENTLY IF NOT EXISTS "{INDEX}" ON "events_event" '
                    '("org_id")',
                )
            ],
            state_operations=[
                migrations.AlterField(
                    model_name="event",
                    name="org",
                    field=models.ForeignKey(
                        blank=True,
                        db_index=False,
                        null=True,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="+",
                        to="orgs.organization",
                    ),
                )
            ],
        )
    ]
