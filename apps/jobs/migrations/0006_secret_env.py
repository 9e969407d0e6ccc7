from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("jobs", "0005_convergence_deadlines")]

    operations = [
        migrations.AddField(
            model_name="jobconfiguration",
            name="secret_env_encrypted",
            field=models.TextField(blank=True, default="", editable=False),
        ),
        migrations.AddField(
            model_name="job",
            name="secret_env_encrypted",
            field=models.TextField(blank=True, default="", editable=False),
        ),
    ]
