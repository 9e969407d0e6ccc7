"""A web process loads its views when it starts, not in its first request."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import sys
before = "apps.github.webhooks" in sys.modules
import config.wsgi
print(before, "apps.github.webhooks" in sys.modules, "apps.gitlab.webhooks" in sys.modules)
"""


def test_the_wsgi_application_has_every_view_loaded_before_its_first_request() -> None:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings_test"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    # the forges' webhooks: the first request a deployment gets is often one of theirs
    assert out.stdout.split() == ["False", "True", "True"], out.stdout + out.stderr
