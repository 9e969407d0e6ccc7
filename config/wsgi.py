from __future__ import annotations

import os

import django
from django.core.handlers.wsgi import WSGIHandler

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

django.setup(set_prefix=False)

from apps.core import tracing  # noqa: E402

tracing.setup("web")  # before the handler loads the middleware: Django's instrumentation adds one
application = WSGIHandler()
