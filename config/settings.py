"""Settings, all from the environment (twelve-factor).

Every variable is documented in docs/operator/configuration.md. Secrets can be given as
``NAME`` or as ``NAME_FILE`` pointing at a file (docker/k8s secrets): django-environ's
FileAwareEnv reads both. Values that would be dangerous are refused at start-up.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from collections.abc import Callable
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.FileAwareEnv()

CATACLOUD_HOME = Path(os.environ.get("CATACLOUD_HOME", BASE_DIR / ".catacloud")).expanduser().resolve()
# `make dev` writes the embedded services' URLs here so that plain `manage.py` finds them.
# Real environment variables always win over this file.
if (CATACLOUD_HOME / ".env").is_file():
    env.read_env(str(CATACLOUD_HOME / ".env"), overwrite=False)

DEBUG = env.bool("DJANGO_DEBUG", default=False)


def _home_secret(name: str, make: Callable[[], str]) -> str:
    """A development secret generated once and kept under CATACLOUD_HOME (never in git)."""
    path = CATACLOUD_HOME / name
    if not path.exists():
        CATACLOUD_HOME.mkdir(parents=True, exist_ok=True)
        path.write_text(make())
        path.chmod(0o600)
    return path.read_text().strip()


def _required_secret(name: str, make: Callable[[], str]) -> str:
    value = env.str(name, default="")
    if value:
        return value
    if DEBUG or env.bool("CATACLOUD_EMBEDDED", default=False):
        return _home_secret(name.lower(), make)
    raise ImproperlyConfigured(f"{name} (or {name}_FILE) must be set when DJANGO_DEBUG is off")


SECRET_KEY = _required_secret("DJANGO_SECRET_KEY", lambda: secrets.token_urlsafe(50))


def _fernet_key() -> str:
    from cryptography.fernet import Fernet

    return Fernet.generate_key().decode()


# Comma-separated Fernet keys; the first encrypts, all decrypt (rotation).
CATACLOUD_ENCRYPTION_KEYS = _required_secret("CATACLOUD_ENCRYPTION_KEY", _fernet_key).split(",")

# Bootstrap tokens (machines' single-use enrollment): comma-separated keys, the first signs, all
# verify (rotation); and how long after a machine's creation its token is accepted.
CATACLOUD_BOOTSTRAP_KEYS = _required_secret(
    "CATACLOUD_BOOTSTRAP_KEYS", lambda: secrets.token_urlsafe(48)
).split(",")
CATACLOUD_BOOTSTRAP_TOKEN_TTL = env.int("CATACLOUD_BOOTSTRAP_TOKEN_TTL", default=6 * 3600)

ALLOWED_HOSTS = env.list("DJANGO_ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env.list("DJANGO_CSRF_TRUSTED_ORIGINS", default=[])

# Production behind TLS (docs/security.md, `manage.py check --deploy` passes with these set).
# Behind a proxy that terminates TLS, trust its X-Forwarded-Proto header (only then).
if env.bool("DJANGO_SECURE_PROXY_SSL_HEADER", default=False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env.bool("DJANGO_SECURE_SSL_REDIRECT", default=False)
# /livez, /readyz and /healthz answer probes over plain HTTP inside the cluster.
SECURE_REDIRECT_EXEMPT = [r"^(healthz|livez|readyz)$"]

SECURE_HSTS_SECONDS = env.int("DJANGO_SECURE_HSTS_SECONDS", default=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool("DJANGO_SECURE_HSTS_INCLUDE_SUBDOMAINS", default=False)
SECURE_HSTS_PRELOAD = env.bool("DJANGO_SECURE_HSTS_PRELOAD", default=False)
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = env.bool("DJANGO_SECURE_COOKIES", default=False)
SESSION_COOKIE_HTTPONLY = True
X_FRAME_OPTIONS = "DENY"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI and ReDoc served from our static files, no CDN
    "django_htmx",  # vendors htmx.min.js for the console's live dashboard (no JS build step)
    "apps.core",
    "apps.orgs",
    "apps.machines",
    "apps.pools",
    "apps.jobs",
    "apps.resources",
    "apps.events",
    "apps.ci",
    "apps.github",
    "apps.gitlab",
    "apps.billing",
    "apps.control",
]

MIDDLEWARE = [
    "apps.core.metrics.RequestMetricsMiddleware",
    "apps.core.middleware.ApiJsonErrorsMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "apps.core.middleware.ApiTrailingSlashMiddleware",  # before CommonMiddleware's APPEND_SLASH
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        # config/templates: the console's admin/base_site.html (stylesheet, dashboard link).
        "DIRS": [BASE_DIR / "config" / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

if not os.environ.get("DATABASE_URL"):
    raise ImproperlyConfigured(
        "DATABASE_URL is not set. `make dev` starts an embedded PostgreSQL and sets it; "
        "otherwise point it at PostgreSQL, e.g. postgresql://user:pass@host:5432/catacloud"
    )
DATABASES = {"default": env.db_url("DATABASE_URL", engine="django.db.backends.postgresql")}
if DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
    raise ImproperlyConfigured("Catacloud runs on PostgreSQL only (claims use FOR UPDATE SKIP LOCKED)")
if env.str("DATABASE_PASSWORD", default=""):  # or DATABASE_PASSWORD_FILE, to keep it out of the URL
    DATABASES["default"]["PASSWORD"] = env.str("DATABASE_PASSWORD")
DATABASES["default"]["CONN_MAX_AGE"] = env.int("DATABASE_CONN_MAX_AGE", default=60)
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
DATABASES["default"].setdefault("TEST", {})["NAME"] = env.str("DATABASE_TEST_NAME", default="test_catacloud")

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
# The console shows times to the second (config/formats/en/formats.py).
FORMAT_MODULE_PATH = ["config.formats"]
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = env.path("DJANGO_STATIC_ROOT", default=str(CATACLOUD_HOME / "static"))
Path(STATIC_ROOT).mkdir(parents=True, exist_ok=True)

# ---- Redis and Celery ---------------------------------------------------------------------------

REDIS_URL = env.str("REDIS_URL", default="redis://127.0.0.1:6379/0")
# (The test suite's settings, config/settings_test.py, move it to another Redis database.)

CELERY_BROKER_URL = REDIS_URL
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_IGNORE_RESULT = True
CELERY_RESULT_BACKEND = None
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_TASK_TIME_LIMIT = env.int("CELERY_TASK_TIME_LIMIT", default=600)
CELERY_TASK_SOFT_TIME_LIMIT = env.int("CELERY_TASK_SOFT_TIME_LIMIT", default=540)
# With acks_late a task whose worker died is redelivered after the visibility timeout.
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": env.int("CELERY_VISIBILITY_TIMEOUT", default=900),
    # A publish while Redis is down fails fast instead of hanging the request.
    "socket_connect_timeout": 2,
}
CELERY_BROKER_CONNECTION_TIMEOUT = 2
CELERY_WORKER_SEND_TASK_EVENTS = True  # Flower
# Celery's Django fixup closes every database connection before and after every task unless this
# is set: a new PostgreSQL connection, password exchange included, for each task. config/celery.py
# closes them as Django does around a request instead (DATABASE_CONN_MAX_AGE, broken connections).
CELERY_DB_REUSE_MAX = 1_000_000
# No extra "task-sent" message per task: it doubled the broker traffic of every claim.
CELERY_TASK_SEND_SENT_EVENT = False

CATACLOUD_REAPER_INTERVAL = env.float("CATACLOUD_REAPER_INTERVAL", default=60.0)
if CATACLOUD_REAPER_INTERVAL < 1:
    raise ImproperlyConfigured("CATACLOUD_REAPER_INTERVAL must be at least 1 second")
# Every Celery worker (and beat) runs a reaper loop; one of them, elected by a PostgreSQL
# advisory lock, ticks (apps/control/election.py). Off: only beat stands for election.
CATACLOUD_REAPER_IN_WORKERS = env.bool("CATACLOUD_REAPER_IN_WORKERS", default=True)
# Threads of the leader that run the tick's repairs (re-drives of rows past their deadline).
CATACLOUD_REAPER_REPAIR_THREADS = env.int("CATACLOUD_REAPER_REPAIR_THREADS", default=4)
CATACLOUD_SCHEDULER_INTERVAL = env.float("CATACLOUD_SCHEDULER_INTERVAL", default=15.0)

# The beat schedule lives here, in one settings module, not in django-celery-beat's tables:
# it is part of the code (reviewed, versioned, the same on every deployment), its periods
# come from the environment, and there is no second source of truth to drift. Operators
# see it in README and in Flower; they tune it with the variables above.
# The reaper is not in it: beat runs the reaper in a thread of its own process (config/celery.py),
# so a tick never depends on the broker or a worker.
CELERY_BEAT_SCHEDULE = {
    "scheduler": {
        "task": "apps.jobs.tasks.schedule_task",
        "schedule": CATACLOUD_SCHEDULER_INTERVAL,
        "options": {"expires": CATACLOUD_SCHEDULER_INTERVAL * 0.9},
    },
    "heartbeat": {
        "task": "apps.core.tasks.beat_heartbeat_task",
        "schedule": 10.0,
        "options": {"expires": 9.0},
    },
}

# ---- Catacloud --------------------------------------------------------------------------------

# Label value that marks this installation's machines at every provider. Two installations
# sharing one cloud project must differ here, or their reconcilers will fight.
CATACLOUD_INSTALLATION = env.str("CATACLOUD_INSTALLATION", default="")
# A built catacloud-agent wheel (or a folder holding one) the Agent API serves at
# /api/agent/v1/dist/<file>; cloud machines install it from there, pinned by sha256, and from
# nowhere else: without it no cloud machine is made (apps/machines/agent_dist.py).
CATACLOUD_AGENT_WHEEL = env.str("CATACLOUD_AGENT_WHEEL", default="")
if "CATACLOUD_AGENT_PACKAGE" in os.environ:
    raise ImproperlyConfigured(
        "CATACLOUD_AGENT_PACKAGE is gone: machines install the agent only from the control plane, "
        "the wheel CATACLOUD_AGENT_WHEEL names, pinned by its sha256 (the Docker image sets it)"
    )
# Agent heartbeats: how often agents beat, and how long a silence makes an instance lost.
CATACLOUD_HEARTBEAT_INTERVAL = env.float("CATACLOUD_HEARTBEAT_INTERVAL", default=5.0)
CATACLOUD_AGENT_LOST_AFTER = env.float("CATACLOUD_AGENT_LOST_AFTER", default=60.0)
# Long-poll: how long an idle agent's GET work waits before answering 204.
CATACLOUD_AGENT_POLL_TIMEOUT = env.float("CATACLOUD_AGENT_POLL_TIMEOUT", default=20.0)
# The agent server closes a connection whose request header is not complete this many
# seconds after it connected (or after the first byte of its next request); 0: no limit.
CATACLOUD_AGENT_HEADER_TIMEOUT = env.float("CATACLOUD_AGENT_HEADER_TIMEOUT", default=5.0)
# Connection budgets of the agent server, per process (apps/control/agent/limits.py; 0: no limit):
# connections one machine (one agent token) may hold; its next request is answered 429 ...
CATACLOUD_AGENT_MAX_CONNECTIONS_PER_MACHINE = env.int(
    "CATACLOUD_AGENT_MAX_CONNECTIONS_PER_MACHINE", default=16
)
# ... connections no machine has claimed yet (no header yet, no or an unknown token), in all and
# from one address: past either, the oldest of them is closed to make room for the new one.
CATACLOUD_AGENT_MAX_UNAUTHENTICATED = env.int("CATACLOUD_AGENT_MAX_UNAUTHENTICATED", default=2048)
CATACLOUD_AGENT_MAX_UNAUTHENTICATED_PER_ADDRESS = env.int(
    "CATACLOUD_AGENT_MAX_UNAUTHENTICATED_PER_ADDRESS", default=512
)
_agent_limits = {
    "CATACLOUD_AGENT_HEADER_TIMEOUT": CATACLOUD_AGENT_HEADER_TIMEOUT,
    "CATACLOUD_AGENT_MAX_CONNECTIONS_PER_MACHINE": CATACLOUD_AGENT_MAX_CONNECTIONS_PER_MACHINE,
    "CATACLOUD_AGENT_MAX_UNAUTHENTICATED": CATACLOUD_AGENT_MAX_UNAUTHENTICATED,
    "CATACLOUD_AGENT_MAX_UNAUTHENTICATED_PER_ADDRESS": CATACLOUD_AGENT_MAX_UNAUTHENTICATED_PER_ADDRESS,
}
if any(value < 0 for value in _agent_limits.values()):
    raise ImproperlyConfigured(f"{', '.join(_agent_limits)} must be >= 0")
if "CATACLOUD_AGENT_MAX_CONNECTIONS_PER_CLIENT" in os.environ:
    # a cap per address starved every machine behind one NAT address: the budgets are per machine now
    raise ImproperlyConfigured(
        "CATACLOUD_AGENT_MAX_CONNECTIONS_PER_CLIENT is gone: the agent server limits each machine "
        "(CATACLOUD_AGENT_MAX_CONNECTIONS_PER_MACHINE) and unauthenticated connections "
        "(CATACLOUD_AGENT_MAX_UNAUTHENTICATED, CATACLOUD_AGENT_MAX_UNAUTHENTICATED_PER_ADDRESS)"
    )
# Requests per agent (per machine): heartbeats, log posts every 0.5 s, one upload per output.
CATACLOUD_AGENT_RATE = env.str("CATACLOUD_AGENT_RATE", default="1200/min")
# A submit admits and places its grant's queued jobs in its own request (after its commit) when
# no other transaction holds the grant, instead of leaving it all to the scheduling pass.
CATACLOUD_SCHEDULE_ON_SUBMIT = env.bool("CATACLOUD_SCHEDULE_ON_SUBMIT", default=True)
# A labelled machine with no live row is deleted only after this grace (creation in flight).
CATACLOUD_RECONCILE_GRACE = env.float("CATACLOUD_RECONCILE_GRACE", default=120.0)
# Networks the webhook well may reach although they are not public: private, loopback,
# link-local (169.254.169.254, the clouds' metadata service) and other reserved addresses are
# refused unless listed here (comma-separated CIDRs, e.g. "10.20.0.0/16,127.0.0.1/32").
CATACLOUD_WEBHOOK_ALLOW_NETWORKS = [
    str(ipaddress.ip_network(n.strip(), strict=False))
    for n in env.list("CATACLOUD_WEBHOOK_ALLOW_NETWORKS", default=[])
    if n.strip()
]
# The currency of the price list (machine types' price_per_hour, budgets' amounts).
CATACLOUD_CURRENCY = env.str("CATACLOUD_CURRENCY", default="USD")
# Billing-aware retention: an idle machine is destroyed this many seconds before its paid
# period ends (must exceed the reaper interval, which is when the check runs).
CATACLOUD_RETENTION_MARGIN = env.float(
    "CATACLOUD_RETENTION_MARGIN", default=max(120.0, 2 * CATACLOUD_REAPER_INTERVAL)
)
# Deadlines (seconds) of the states the reaper converges; the table of docs/architecture/convergence.md.
# A row moved by a task (pending and provisioning instances, terminating ones, requested and
# releasing resources, jobs acquiring resources) has that task sent again after this long.
CATACLOUD_REDRIVE_AFTER = env.float("CATACLOUD_REDRIVE_AFTER", default=60.0)
# A machine outside a pool that has not become ready this long after its request is
# terminated (pool members use their pool's warmup_grace_seconds).
CATACLOUD_BOOT_TIMEOUT = env.float("CATACLOUD_BOOT_TIMEOUT", default=600.0)
# Organizations' own cloud accounts (apps/machines/owned.py): the provider kinds an organization
# admin may add an account of (empty: none). Only cloud kinds: local, fake and hosts never.
CATACLOUD_ORG_PROVIDER_KINDS = env.list("CATACLOUD_ORG_PROVIDER_KINDS", default=["hetzner", "aws", "azure"])
# Where organizations' accounts send their calls, per kind, set by the operator alone (an
# organization never points the control plane at an address of its choosing); empty: the
# provider's public API. E.g. {"hetzner": {"api_endpoint": "https://..."}, "aws": {"endpoint_url": "..."}}.
CATACLOUD_ORG_PROVIDER_SETTINGS = env.json("CATACLOUD_ORG_PROVIDER_SETTINGS", default={})
# A provider's capacity error cools its machine type down this long: none of it is bought, and
# waiting jobs move to their next candidate (apps/machines/capacity.py; Karpenter: 3 minutes).
CATACLOUD_CAPACITY_COOLDOWN = env.float("CATACLOUD_CAPACITY_COOLDOWN", default=180.0)
# A job assigned to a machine whose agent has not started it within this is requeued
# (not_started) and the machine terminated.
CATACLOUD_ASSIGN_TIMEOUT = env.float("CATACLOUD_ASSIGN_TIMEOUT", default=300.0)
# A machine held for a finished job's uploads is released this long after the job ended even
# if the agent never says uploads-done.
CATACLOUD_UPLOAD_TIMEOUT = env.float("CATACLOUD_UPLOAD_TIMEOUT", default=900.0)
# The longest an agent spends pulling a job's (or a pool's) image; a job's own timeout, counted
# from its start with the pull in it, may end it sooner. Past it: image_pull_timeout.
CATACLOUD_IMAGE_PULL_TIMEOUT = env.float("CATACLOUD_IMAGE_PULL_TIMEOUT", default=900.0)
# A resource still `creating` after this (its worker died mid-create) is created again
# (wells create idempotently by resource id). Longer than a task may run.
CATACLOUD_RESOURCE_CREATE_TIMEOUT = env.float(
    "CATACLOUD_RESOURCE_CREATE_TIMEOUT", default=float(CELERY_TASK_TIME_LIMIT + 60)
)
# Replace pool members built from an older machine type version (drift).
CATACLOUD_REPLACE_OUTDATED = env.bool("CATACLOUD_REPLACE_OUTDATED", default=True)
# Where job outputs and checkpoints are kept: "local" (a directory; the embedded default) or "s3".
CATACLOUD_STORAGE = env.str("CATACLOUD_STORAGE", default="local")
if CATACLOUD_STORAGE not in ("local", "s3"):
    raise ImproperlyConfigured("CATACLOUD_STORAGE must be local or s3")
CATACLOUD_STORAGE_DIR = env.str("CATACLOUD_STORAGE_DIR", default=str(CATACLOUD_HOME / "artifacts"))
CATACLOUD_S3_BUCKET = env.str("CATACLOUD_S3_BUCKET", default="")
CATACLOUD_S3_PREFIX = env.str("CATACLOUD_S3_PREFIX", default="catacloud")
CATACLOUD_S3_ENDPOINT_URL = env.str("CATACLOUD_S3_ENDPOINT_URL", default="")
CATACLOUD_S3_REGION = env.str("CATACLOUD_S3_REGION", default="")
CATACLOUD_S3_ACCESS_KEY_ID = env.str("CATACLOUD_S3_ACCESS_KEY_ID", default="")
CATACLOUD_S3_SECRET_ACCESS_KEY = env.str("CATACLOUD_S3_SECRET_ACCESS_KEY", default="")
CATACLOUD_S3_MULTIPART_MB = env.int("CATACLOUD_S3_MULTIPART_MB", default=16)
CATACLOUD_S3_PRESIGN = env.bool("CATACLOUD_S3_PRESIGN", default=True)
if CATACLOUD_STORAGE == "s3" and not CATACLOUD_S3_BUCKET:
    raise ImproperlyConfigured("CATACLOUD_S3_BUCKET must be set when CATACLOUD_STORAGE=s3")
# Optional bearer token Prometheus must send to scrape /metrics.
CATACLOUD_METRICS_TOKEN = env.str("CATACLOUD_METRICS_TOKEN", default="")
# /metrics names every org and pool: closed unless a token is set or it is opened on purpose.
CATACLOUD_METRICS_PUBLIC = env.bool("CATACLOUD_METRICS_PUBLIC", default=False)
# An unregistered event kind or error code raises (tests, development) instead of being logged.
CATACLOUD_STRICT_REGISTRIES = env.bool("CATACLOUD_STRICT_REGISTRIES", default=DEBUG)
# Public URL agents use to reach the API (put into cloud-init user data).
CATACLOUD_PUBLIC_URL = env.str("CATACLOUD_PUBLIC_URL", default="http://127.0.0.1:8000")
# Where agents reach the Agent API: the agent server (`catacloud agent-server`, ASGI), which holds
# thousands of idle long polls without a thread each. Defaults to the public URL (the WSGI web
# serves the Agent API too, but each of its long polls holds one of its threads).
CATACLOUD_AGENT_URL = env.str("CATACLOUD_AGENT_URL", default="") or CATACLOUD_PUBLIC_URL

# ---- GitHub Actions (apps/github) ---------------------------------------------------------------
# The runner folder a machine's image provides (a runner class may name another one); the
# default runner command copies it into the job's work folder and runs ./run.sh --jitconfig.
CATACLOUD_GITHUB_RUNNER_DIR = env.str("CATACLOUD_GITHUB_RUNNER_DIR", default="/opt/actions-runner")
# Seconds between reconciles of an installation (runners, missed webhooks); at most the
# reaper interval matters as the reaper's tick sends them.
CATACLOUD_GITHUB_RECONCILE_INTERVAL = env.float("CATACLOUD_GITHUB_RECONCILE_INTERVAL", default=30.0)
# GitHub calls per installation per hour Catacloud allows itself: 90 % of the 5,000 GitHub grants
# an installation at least (the reconciler's runner upkeep stops at 80 % of it, its polls at 50 %).
CATACLOUD_GITHUB_REQUEST_BUDGET = env.int("CATACLOUD_GITHUB_REQUEST_BUDGET", default=4500)
# Seconds a GitHub call may take.
CATACLOUD_GITHUB_TIMEOUT = env.float("CATACLOUD_GITHUB_TIMEOUT", default=10.0)
# The largest webhook delivery accepted (GitHub caps payloads at 25 MB; workflow_job ones are ~10 KB).
CATACLOUD_GITHUB_WEBHOOK_MAX_BYTES = env.int("CATACLOUD_GITHUB_WEBHOOK_MAX_BYTES", default=1_048_576)

# Simulations only: the forges' documented limits' windows and waits (a minute, an hour, a week)
# are this many times shorter, as the fakes' clocks run when they simulate a week in minutes.
CATACLOUD_CI_LIMIT_TIME_SCALE = env.float("CATACLOUD_CI_LIMIT_TIME_SCALE", default=1.0)

# ---- GitLab CI (apps/gitlab) -------------------------------------------------------------------
# The gitlab-runner a machine's image provides (a runner class may name another one); the
# default runner command runs `gitlab-runner run-single` for one job.
CATACLOUD_GITLAB_RUNNER = env.str("CATACLOUD_GITLAB_RUNNER", default="gitlab-runner")
# Seconds between reconciles of a connection (runners, missed webhooks); the reaper's tick sends them.
CATACLOUD_GITLAB_RECONCILE_INTERVAL = env.float("CATACLOUD_GITLAB_RECONCILE_INTERVAL", default=30.0)
# GitLab calls per connection per hour Catacloud allows itself (background calls: 80 % of it).
# A job costs about three (its tags, its runner, the runner's deletion), so this is ~12,000 jobs
# an hour; GitLab.com allows a user 2,000 calls a minute, and GitLab's own RateLimit-* answers are
# honoured on top of this.
CATACLOUD_GITLAB_REQUEST_BUDGET = env.int("CATACLOUD_GITLAB_REQUEST_BUDGET", default=36000)
# Seconds a GitLab call may take.
CATACLOUD_GITLAB_TIMEOUT = env.float("CATACLOUD_GITLAB_TIMEOUT", default=10.0)
# The largest webhook delivery accepted (GitLab's Job events are a few KB).
CATACLOUD_GITLAB_WEBHOOK_MAX_BYTES = env.int("CATACLOUD_GITLAB_WEBHOOK_MAX_BYTES", default=1_048_576)

# ---- the agent server (config/agent_asgi.py) ---------------------------------------------------
# Set by config/agent_asgi.py: this process serves only the Agent API, asynchronously.
CATACLOUD_AGENT_SERVER = env.bool("CATACLOUD_AGENT_SERVER", default=False)
# Threads (each with one persistent database connection) the agent server runs queries on.
CATACLOUD_AGENT_DB_THREADS = env.int("CATACLOUD_AGENT_DB_THREADS", default=8)
# Asynchronous connections for the hot statements (heartbeat, a poll's look-ups), held only for
# the statement itself.
CATACLOUD_AGENT_DB_CONNECTIONS = env.int("CATACLOUD_AGENT_DB_CONNECTIONS", default=4)
if CATACLOUD_AGENT_SERVER:
    ROOT_URLCONF = "config.agent_urls"
    # Only async-capable middleware: a sync one would hold a thread for every waiting poll.
    MIDDLEWARE = ["apps.core.middleware.ApiJsonErrorsMiddleware"]

# ---- REST framework ---------------------------------------------------------------------------

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "apps.orgs.auth.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    # orjson renders several times faster than the standard library's json (same output).
    "DEFAULT_RENDERER_CLASSES": [
        "drf_orjson_renderer.renderers.ORJSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
    # limit, offset, ordering and filter values that make no sense are a 400 naming what would
    # (DRF and django-filter ignore them, or answer "Select a valid choice").
    "DEFAULT_PAGINATION_CLASS": "apps.core.listing.LimitOffsetPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_FILTER_BACKENDS": [
        "apps.core.listing.FilterBackend",
        "apps.core.listing.OrderingFilter",
    ],
    "DEFAULT_PARSER_CLASSES": [
        "apps.core.parsers.SafeJSONParser",
        "apps.core.parsers.StrictFormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_SCHEMA_CLASS": "apps.core.schema.AutoSchema",
    "EXCEPTION_HANDLER": "apps.core.api.exception_handler",
    # In-process counts (no Redis round trip on every request; never fails with Redis).
    "DEFAULT_THROTTLE_CLASSES": ["apps.core.throttling.UserRateThrottle"],
    # Fairness only; quotas are enforced in PostgreSQL.
    "DEFAULT_THROTTLE_RATES": {"user": env.str("CATACLOUD_API_RATE", default="6000/min")},
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
}

CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": "catacloud",
        # The cache only memoises health: it must never hang a request.
        "OPTIONS": {"socket_connect_timeout": 1, "socket_timeout": 1},
    },
    # In-process: the API throttle (fairness only) costs no network round trip.
    "local": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "catacloud"},
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Catacloud API",
    "DESCRIPTION": "Warm pools, jobs and resources on ephemeral cloud machines.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SCHEMA_PATH_PREFIX": "/api/v1",
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "ENUM_NAME_OVERRIDES": {
        "InstanceStatusEnum": "apps.machines.choices.InstanceStatus",
        "PoolStatusEnum": "apps.pools.choices.PoolStatus",
        "JobStatusEnum": "apps.jobs.choices.JobStatus",
        "ResourceStatusEnum": "apps.resources.choices.ResourceStatus",
    },
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
    "loggers": {"django.db.backends": {"level": "WARNING"}},
}

LOGIN_URL = "admin:login"
