"""The client side of ``catacloud``: ``jobs``, ``pools`` and ``artifacts`` commands on the REST
API (``requests``, no Django), for people (tables, progress) and scripts (``--json``)."""
