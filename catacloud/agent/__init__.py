"""The Catacloud agent: the framework-free program on every machine.

It enrolls with the Agent API, heartbeats, long-polls for one job at a time, runs it in its own
process tree, streams its output, reports its outcome, uploads its output files, saves and
restores its checkpoint directory, serves ``catacloud job-meta`` and ``catacloud checkpoint`` to
the job over a private Unix socket, and watches for spot interruption notices.

It ships as its own distribution, ``catacloud-agent`` (``agent/pyproject.toml``: this package and
``requests`` and ``psutil``, nothing of the server), which is all a cloud machine installs. It
imports nothing from the rest of ``catacloud`` but the protocol it speaks with the control plane
(``catacloud.protocol``, shipped with it): on a machine, ``catacloud`` is a namespace package
holding only those two.
"""

from __future__ import annotations

__version__ = "0.2.0"  # the catacloud-agent distribution's (agent/pyproject.toml)
AGENT_API_PREFIX = "/api/agent/v1/"
