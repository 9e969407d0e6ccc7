"""The unique index of a job's Idempotency-Key within its organization, built CONCURRENTLY: the
jobs table stays readable and writable while it is built (a plain CREATE INDEX would lock out
every agent, the scheduler and the API for the whole build on a large table)."""

from django.db import migrations, models

INDEX = "job_idempotency_key_unique_in_org"


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("jobs", "0010_job_idempotency_key")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    f'CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS "{INDEX}" ON "jobs_job" '
                    '("org_id", "idempotency_key") WHERE NOT ("idempotency_key" = \'\')',
                    reverse_sql=f'DROP INDEX CONCURRENTLY IF EXISTS "{INDEX}"',
                )
            ],
            state_operations=[
                migrations.AddConstraint(
                    model_name="job",
                    constraint=models.UniqueConstraint(
                        condition=models.Q(("idempotency_key", ""), _negated=True),
                        fields=("org", "idempotency_key"),
                        name=INDEX,
                    ),
                )
            ],
        )
    ]
