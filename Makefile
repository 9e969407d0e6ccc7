# Catacloud: `make dev` runs the whole system on embedded services, `make test` runs the tests.
# Both bootstrap everything they need into .venv (Python 3.11+ is the only prerequisite).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.test-installed
PYTEST_ARGS ?=
# The test files run on this many pytest processes (pytest-xdist), each with its own database
# and Redis database; 0 runs them in this one.
TEST_WORKERS ?= 2

.PHONY: dev test lint format docs bench chaos services-up services-down clean

# What running needs (`make dev`): the package, catacloud-agent (agent/pyproject.toml, the
# server's dependency, installed from this tree) and the embedded services.
$(STAMP): pyproject.toml agent/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ./agent -e '.[dev]'
	@# a venv from before the split: upgrading the server removed its old `catacloud` script
	test -x $(VENV)/bin/catacloud || $(PY) -m pip install --quiet --no-deps --force-reinstall -e ./agent
	touch $(STAMP)

# What testing needs on top (`make test`, `make lint`): pytest, Playwright, moto, matplotlib, ruff.
$(TEST_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(TEST_STAMP)

## Run web + agent server + worker + beat + Flower on embedded PostgreSQL and Redis, with demo data.
## Ctrl-C stops everything (exit status 0).
# The time `make dev` started (expanded when make reads this file, before the bootstrap): the
# "ready" banner counts the user's whole wait from it. `exec`: the runner replaces the shell make
# starts it through, so a stop signal to make's process group reaches no shell that would die of
# it at once, and make returns only once the runner has stopped everything.
dev: DEV_STARTED := $(shell date +%s)
dev: $(STAMP)
	@CATACLOUD_DEV_STARTED=$(DEV_STARTED) exec $(PY) -m catacloud.cli dev

## Run the test suite against real PostgreSQL and Redis (embedded unless DATABASE_URL/REDIS_URL are set).
test: $(TEST_STAMP)
	$(PY) -m catacloud.cli services run -- $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

## ruff lint and format check; import-linter checks the layers and mypy the types (pyproject.toml).
## mypy's Django plugin reads the settings: development defaults, no database is opened.
lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	DJANGO_DEBUG=1 DATABASE_URL=$${DATABASE_URL:-postgres://lint@127.0.0.1:1/lint} $(VENV)/bin/mypy

format: $(TEST_STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

## The documentation site from docs/ (mkdocs.yml) into site/; a broken link or anchor fails it.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

BENCH_STAMP := $(VENV)/.bench-installed

$(BENCH_STAMP): $(TEST_STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e ./agent -e '.[test,bench]'
	touch $(BENCH_STAMP)

## Benchmarks (writes BENCHMARKS.md); ONLY=claim runs one part. Installs the bench-only peers.
bench: $(BENCH_STAMP)
	$(PY) -m catacloud.cli services run -- $(PY) -m benchmarks $(if $(ONLY),--only $(ONLY))

## Chaos soak (writes its section of BENCHMARKS.md): CHAOS_ARGS="--jobs 1000 --faults 120 --seed 1".
chaos: $(TEST_STAMP)
	$(PY) -m catacloud.cli services run -- $(PY) -m benchmarks.chaos $(CHAOS_ARGS)

services-up: $(STAMP)
	$(PY) -m catacloud.cli services up

services-down: $(STAMP)
	$(PY) -m catacloud.cli services down

## Stop the embedded services and delete their data.
clean:
	-$(PY) -c "from catacloud.embedded import wipe; wipe()"
