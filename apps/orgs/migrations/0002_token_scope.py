"""Job-scoped tokens: the job link becomes an opaque ``scope`` string (``job:<uuid>``), so the
orgs app no longer points up at jobs (layers, issue 16). Existing job tokens keep their scope."""

from django.db import migrations, models


def copy_job_to_scope(apps, schema_editor):
    ApiToken = apps.get_model("orgs", "ApiToken")
    for token in ApiToken.objects.filter(job__isnull=False).only("pk", "job_id"):
        ApiToken.objects.filter(pk=token.pk).update(scope=f"job:{token.job_id}")


def copy_scope_to_job(apps, schema_editor):
    ApiToken = apps.get_model("orgs", "ApiToken")
    for token in ApiToken.objects.filter(scope__startswith="job:").only("pk", "scope"):
        ApiToken.objects.filter(pk=token.pk).update(job_id=token.scope.removeprefix("job:"))


class Migration(migrations.Migration):
    dependencies = [
        ("orgs", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="apitoken",
            name="scope",
            field=models.CharField(blank=True, default="", editable=False, max_length=64),
        ),
        migrations.RunPython(copy_job_to_scope, copy_scope_to_job),
        migrations.RemoveField(model_name="apitoken", name="job"),
    ]
