# One image for web, agent server, worker, beat and Flower; docker-compose.yml picks the command.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 DJANGO_SETTINGS_MODULE=config.settings
WORKDIR /app
COPY pyproject.toml README.md ./
COPY agent ./agent
COPY catacloud ./catacloud
COPY apps ./apps
COPY config ./config
COPY manage.py ./
# catacloud-agent first: the server package depends on it (built from the same tree). Its wheel
# also goes to /app/dist: the Agent API serves it to cloud machines, whose user data installs it
# pinned by sha256 (CATACLOUD_AGENT_WHEEL, apps/machines/agent_dist.py).
# The server with its tracing extra: OTEL_* variables in the environment turn tracing on
# (docs/operator/operations.md); without them it stays off.
ENV CATACLOUD_AGENT_WHEEL=/app/dist
RUN pip wheel --no-deps -w /app/dist ./agent && pip install ./agent '.[tracing]' && useradd --system --uid 1000 catacloud \
    && mkdir -p /var/lib/catacloud && chown catacloud /var/lib/catacloud  # the volume starts owned by it
USER catacloud
EXPOSE 8000 8001
CMD ["gunicorn", "config.wsgi", "--bind", "0.0.0.0:8000", "--workers", "4", "--threads", "32"]
