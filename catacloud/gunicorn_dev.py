"""gunicorn settings for `make dev` (``--config python:catacloud.gunicorn_dev``).

Ctrl-C sends gunicorn SIGINT, its quick shutdown: the master passes it on to the workers as
SIGQUIT and each worker calls ``worker_int`` then ``sys.exit``, which waits for the worker's
request threads. Agents keep long polls open (``CATACLOUD_AGENT_POLL_TIMEOUT``, 20 s), so a
worker would linger until the master's ``graceful_timeout`` and die of SIGKILL ("Perhaps out of
memory?"). In development a request in flight at Ctrl-C has nobody waiting for it: leave at once.
"""

from __future__ import annotations

import os
from typing import Any

graceful_timeout = 3  # in case a worker is stuck elsewhere


def worker_int(worker: Any) -> None:
    os._exit(0)
