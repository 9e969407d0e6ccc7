"""Django project configuration. Importing it loads the Celery app so tasks find it."""

from config.celery import app as celery_app

__all__ = ["celery_app"]
