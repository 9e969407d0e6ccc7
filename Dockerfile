# One image for web, worker, beat and Flower; docker-compose.yml picks the command.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 DJANGO_SETTINGS_MODULE=config.settings
WORKDIR /app
COPY pyproject.toml README.md ./
COPY catacloud ./catacloud
COPY apps ./apps
COPY config ./config
COPY manage.py ./
RUN pip install . && useradd --system --uid 1000 catacloud \
    && mkdir -p /var/lib/catacloud && chown catacloud /var/lib/catacloud  # the volume starts owned by it
USER catacloud
EXPOSE 8000
CMD ["gunicorn", "config.wsgi", "--bind", "0.0.0.0:8000", "--workers", "4", "--threads", "32"]
