"""The monitoring deploy/ ships works against the metrics that exist: every metric and label
named by the Prometheus alert rules (deploy/prometheus/catacloud-alerts.yml) and the Grafana
dashboard (deploy/grafana/catacloud-dashboard.json) is in a real /metrics exposition. An alert
over a name /metrics never exports never fires: it would stay silent through the outage it was
written for."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from django.test import override_settings
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.test import APIClient

from apps.machines.choices import InstanceStatus
from apps.machines.models import MachineInstance
from apps.pools.services import pool_create
from testkit.builders import job_config, job_row, warming_instance
from tests.conftest import World

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "catacloud-alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "catacloud-dashboard.json"
SCRAPE = ROOT / "deploy" / "prometheus" / "prometheus.yml"
# Prometheus's own series, and PromQL's words that look like names.
PROMETHEUS_OWN = {"up"}
SELECTOR = re.compile(r"\b(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{(?P<matchers>[^}]*)\}")
MATCHER = re.compile(r"(?P<label>[a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\((?P<labels>[^)]*)\)")
NAME = re.compile(r"\bcatacloud_[a-z0-9_]+\b")


def _exposition() -> dict[str, set[str]]:
    """Every sample name /metrics exports, with its label names, from a real scrape of a
    deployment that has a pool member, a queued job and served a request."""
    body = APIClient().get("/metrics", HTTP_AUTHORIZATION="Bearer scrape").content.decode()
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(body):
        suffixes = {
            "counter": ("_total", "_created"),
            "histogram": ("_bucket", "_count", "_sum", "_created"),
        }.get(family.type, ("",))
        for suffix in suffixes:
            names.setdefault(family.name + suffix, set())
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def _expressions() -> list[tuple[str, str]]:
    rules = yaml.safe_load(RULES.read_text())
    found = [(f"alert {r['alert']}", r["expr"]) for g in rules["groups"] for r in g["rules"]]
    dashboard = json.loads(DASHBOARD.read_text())
    found += [(f"panel {p['title']!r}", t["expr"]) for p in dashboard["panels"] for t in p["targets"]]
    return found


@pytest.mark.django_db
@override_settings(CATACLOUD_METRICS_TOKEN="scrape")
def test_every_alert_and_panel_names_metrics_and_labels_that_exist(world: World) -> None:
    pool = pool_create(
        org=world.org, name="gauge", machine_type=world.machine_type, target_size=1, max_size=2
    )
    member = warming_instance(world.org, world.machine_type, pool=pool)
    MachineInstance.objects.filter(pk=member.pk).update(status=InstanceStatus.READY, ready_at=timezone.now())
    job_row(job_config(world.org, world.machine_type, "c", "x"))
    assert world.client("viewer").get("/api/v1/jobs/").status_code == 200
    exported = _exposition()
    assert {"catacloud_jobs", "catacloud_pool_members", "catacloud_http_requests_total"} <= set(exported)

    problems = []
    expressions = _expressions()
    for where, expr in expressions:
        named = set(NAME.findall(expr))
        if not named and not any(re.search(rf"\b{own}\b", expr) for own in PROMETHEUS_OWN):
            problems.append(f"{where}: names no metric: {expr}")
        problems += [f"{where}: no such metric {name}" for name in sorted(named - set(exported))]
        labels = set().union(*(exported.get(name, set()) for name in named)) | {"le"}
        for m in SELECTOR.finditer(expr):
            if m["name"] in PROMETHEUS_OWN:
                continue
            for label in MATCHER.findall(m["matchers"]):
                if label not in exported.get(m["name"], set()):
                    problems.append(f"{where}: {m['name']} has no label {label}")
        for m in GROUPING.finditer(expr):
            for label in filter(None, (x.strip() for x in m["labels"].split(","))):
                if label not in labels:
                    problems.append(f"{where}: groups by {label}, which none of {sorted(named)} has")
    assert not problems, "\n".join(problems)
    # every metric /metrics exports is watched by a panel or a rule
    watched = {name for _, expr in expressions for name in NAME.findall(expr)}
    families = {
        re.sub(r"_(bucket|count|sum|created|total)$", "", n) for n in exported if n.startswith("catacloud_")
    }
    assert {re.sub(r"_(bucket|count|sum|total)$", "", n) for n in watched} >= families


def test_the_alert_rules_are_well_formed_and_the_scrape_loads_them() -> None:
    rules = yaml.safe_load(RULES.read_text())
    alerts = [r for g in rules["groups"] for r in g["rules"]]
    assert len({r["alert"] for r in alerts}) == len(alerts) >= 6
    for rule in alerts:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert rule["labels"]["severity"] in ("page", "ticket"), rule
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule
    scrape = yaml.safe_load(SCRAPE.read_text())
    assert scrape["rule_files"] == [RULES.name]
    (job,) = scrape["scrape_configs"]
    assert job["job_name"] == "catacloud"  # what CatacloudDown's up{job="catacloud"} selects
    assert job["authorization"]["credentials_file"]  # the metrics token, never inline


def test_the_grafana_dashboard_is_importable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] == "Catacloud"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) >= 8
    for panel in dashboard["panels"]:
        assert panel["targets"] and all(t["expr"] and t["refId"] for t in panel["targets"]), panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
