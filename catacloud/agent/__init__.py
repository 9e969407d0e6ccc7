"""The Catacloud agent: the framework-free program on every machine.

It enrolls with the Agent API, heartbeats, long-polls for one job at a time, runs it in its own
process tree, streams its output, reports its outcome, uploads its output files, saves and
restores its checkpoint directory, serves ``catacloud job-meta`` and ``catacloud checkpoint`` to
the job over a private Unix socket, and watches for spot interruption notices.
"""

from __future__ import annotations

AGENT_API_PREFIX = "/api/agent/v1/"
