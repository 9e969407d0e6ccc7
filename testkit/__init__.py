"""The kit shared by ``tests/`` and ``benchmarks/``: real processes (web, worker, beat) and how
to stop every local machine (``testkit.processes``), builders for the rows both set up (machine
types with their grants, ready instances, job configurations, enrolled agents:
``testkit.builders``) and small loopback servers (``testkit.servers``).

Not shipped with the package (``pyproject.toml`` installs ``catacloud``, ``apps`` and
``config`` only): tests and benchmarks import it from the repository root. Nothing Django is
imported at module level, so ``python -m benchmarks`` can import it before ``django.setup()``.
"""
