from __future__ import annotations

import os

import django
from django.core.handlers.wsgi import WSGIHandler
from django.urls import get_resolver

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

django.setup(set_prefix=False)

from apps.core import tracing  # noqa: E402

tracing.setup("web")  # before the handler loads the middleware: Django's instrumentation adds one
application = WSGIHandler()
# Every view imported now, at the process's start, not in its first request: a web process's
# first answer (a forge's webhook after a deploy, or after gunicorn restarted a worker) took
# about 90 ms longer than the next ones while the URLconf loaded.
get_resolver().url_patterns  # noqa: B018
