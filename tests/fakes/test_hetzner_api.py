"""The fake Hetzner API speaks the documented shapes (checked with plain HTTP, no hcloud)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import requests

from tests.fakes.hetzner_api import FakeHetzner, parse_label_selector

TOKEN = "fake-api-token"


@pytest.fixture(scope="module")
def server() -> Iterator[FakeHetzner]:
    with FakeHetzner(token=TOKEN) as fake:
        yield fake


@pytest.fixture()
def api(server: FakeHetzner) -> Iterator[FakeHetzner]:
    server.reset()
    server.action_polls = 1
    yield server


def call(api: FakeHetzner, method: str, path: str, **kwargs: Any) -> requests.Response:
    headers = {"Authorization": f"Bearer {TOKEN}", **kwargs.pop("headers", {})}
    return requests.request(method, api.url + path, headers=headers, timeout=5, **kwargs)


def create(api: FakeHetzner, name: str, **extra: Any) -> requests.Response:
    body = {"name": name, "server_type": "cx23", "image": "ubuntu-24.04", "location": "fsn1", **extra}
    return call(api, "POST", "/servers", json=body)


def test_requests_without_the_token_get_401_with_the_documented_error_body(api: FakeHetzner) -> None:
    response = requests.get(api.url + "/servers", headers={"Authorization": "Bearer wrong"}, timeout=5)
    assert response.status_code == 401
    assert response.json() == {
        "error": {"code": "unauthorized", "message": "unable to authenticate", "details": {}}
    }


def test_create_returns_server_action_and_the_action_completes(api: FakeHetzner) -> None:
    api.action_polls = 2
    body = create(api, "web-1", labels={"catacloud/instance": "abc"}, user_data="#cloud-config").json()
    assert body["server"]["status"] == "initializing"
    assert body["action"]["status"] == "running"
    assert body["next_actions"] == []
    action_id, server_id = body["action"]["id"], body["server"]["id"]
    assert call(api, "GET", f"/actions/{action_id}").json()["action"]["status"] == "running"
    assert call(api, "GET", f"/actions/{action_id}").json()["action"]["status"] == "success"
    server = call(api, "GET", f"/servers/{server_id}").json()["server"]
    assert server["status"] == "running"
    assert server["labels"] == {"catacloud/instance": "abc"}
    assert api.user_data[server_id] == "#cloud-config"


def test_duplicate_name_is_409_uniqueness_error(api: FakeHetzner) -> None:
    assert create(api, "dup").status_code == 201
    response = create(api, "dup")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "uniqueness_error"
    assert len(api.servers) == 1


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"server_type": "cx9000"}, "server_type"),
        ({"image": "windows-95"}, "image"),
        ({"location": "mars1"}, "location"),
        ({"labels": {"bad key!": "x"}}, "labels"),
        ({"labels": {"hetzner.cloud/x": "a,b"}}, "labels"),
    ],
)
def test_invalid_input_is_422_naming_the_field(api: FakeHetzner, extra: dict, field: str) -> None:
    response = create(api, "x", **extra)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "invalid_input"
    assert error["details"]["fields"][0]["name"] == field
    assert api.servers == {}


def test_pagination_meta(api: FakeHetzner) -> None:
    for i in range(7):
        api.add_server(f"s{i}")
    page = call(api, "GET", "/servers", params={"page": 2, "per_page": 3}).json()
    assert [s["name"] for s in page["servers"]] == ["s3", "s4", "s5"]
    assert page["meta"]["pagination"] == {
        "page": 2,
        "per_page": 3,
        "previous_page": 1,
        "next_page": 3,
        "last_page": 3,
        "total_entries": 7,
    }
    last = call(api, "GET", "/servers", params={"page": 3, "per_page": 3}).json()
    assert last["meta"]["pagination"]["next_page"] is None
    assert call(api, "GET", "/servers", params={"per_page": 51}).status_code == 422


LABELS = {
    "a": {"env": "prod", "tier": "web"},
    "b": {"env": "staging", "tier": "db"},
    "c": {"env": "dev"},
    "d": {},
}


@pytest.mark.parametrize(
    "selector, expected",
    [
        ("env=prod", {"a"}),
        ("env==prod", {"a"}),
        ("env!=prod", {"b", "c", "d"}),
        ("tier", {"a", "b"}),
        ("!tier", {"c", "d"}),
        ("env in (prod,staging)", {"a", "b"}),
        ("env notin (prod,staging)", {"c", "d"}),
        ("env in (prod,staging),!tier", set()),
        ("env in (prod, dev),tier!=db", {"a", "c"}),
        ("env,tier=db", {"b"}),
    ],
)
def test_label_selector(api: FakeHetzner, selector: str, expected: set[str]) -> None:
    matches = parse_label_selector(selector)
    assert {name for name, labels in LABELS.items() if matches(labels)} == expected
    for name, labels in LABELS.items():
        api.add_server(name, labels)
    servers = call(api, "GET", "/servers", params={"label_selector": selector}).json()["servers"]
    assert {s["name"] for s in servers} == expected


def test_name_filter(api: FakeHetzner) -> None:
    api.add_server("alpha")
    api.add_server("beta")
    assert [s["name"] for s in call(api, "GET", "/servers", params={"name": "beta"}).json()["servers"]] == [
        "beta"
    ]


@pytest.mark.parametrize(
    "kind, status, code",
    [
        ("invalid_input", 422, "invalid_input"),
        ("rate_limit", 429, "rate_limit_exceeded"),
        ("resource_unavailable", 412, "resource_unavailable"),
        ("resource_limit_exceeded", 403, "resource_limit_exceeded"),
        ("server_error", 500, "server_error"),
    ],
)
def test_injected_errors_use_the_error_body_and_then_stop(
    api: FakeHetzner, kind: str, status: int, code: str
) -> None:
    api.fail_next("POST /servers", kind)
    response = create(api, "x")
    assert response.status_code == status
    assert response.json()["error"]["code"] == code
    assert api.servers == {}
    assert create(api, "x").status_code == 201


def test_rate_limit_carries_rate_limit_headers(api: FakeHetzner) -> None:
    api.fail_next("GET /servers", "rate_limit", retry_after=2)
    response = call(api, "GET", "/servers")
    assert response.headers["RateLimit-Remaining"] == "0"
    assert response.headers["Retry-After"] == "2"


def test_gateway_errors_are_html(api: FakeHetzner) -> None:
    api.fail_next("GET /servers/{id}", "bad_gateway")
    sid = api.add_server("x")
    response = call(api, "GET", f"/servers/{sid}")
    assert response.status_code == 502
    assert response.headers["Content-Type"].startswith("text/html")
    assert call(api, "GET", f"/servers/{sid}").status_code == 200


def test_drop_after_creates_the_server_but_closes_the_connection(api: FakeHetzner) -> None:
    api.fail_next("POST /servers", "drop_after")
    with pytest.raises(requests.ConnectionError):
        create(api, "lost")
    assert [s["name"] for s in api.servers.values()] == ["lost"]


def test_drop_before_does_nothing_and_closes_the_connection(api: FakeHetzner) -> None:
    api.fail_next("POST /servers", "drop_before")
    with pytest.raises(requests.ConnectionError):
        create(api, "never")
    assert api.servers == {}


def test_failed_action_leaves_the_server_off(api: FakeHetzner) -> None:
    api.fail_next_action(code="server_create_failed")
    body = create(api, "broken").json()
    action = call(api, "GET", f"/actions/{body['action']['id']}").json()["action"]
    assert action["status"] == "error"
    assert action["error"]["code"] == "server_create_failed"
    assert api.servers[body["server"]["id"]]["status"] == "off"


def test_delete_then_404(api: FakeHetzner) -> None:
    sid = api.add_server("x")
    assert call(api, "DELETE", f"/servers/{sid}").json()["action"]["command"] == "delete_server"
    response = call(api, "DELETE", f"/servers/{sid}")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


def test_server_actions_filter_by_status(api: FakeHetzner) -> None:
    api.action_polls = 5
    body = create(api, "slow").json()
    sid = body["server"]["id"]
    running = call(api, "GET", f"/servers/{sid}/actions", params={"status": "running"}).json()["actions"]
    assert [a["id"] for a in running] == [body["action"]["id"]]
    done = call(api, "GET", f"/servers/{sid}/actions", params={"status": "success"}).json()["actions"]
    assert done == []


# ---- the catalog lists --------------------------------------------------------------------------


def test_server_types_name_the_locations_they_are_sold_at_and_a_gone_type_is_not_listed(
    api: FakeHetzner,
) -> None:
    """Per-location server types (changelog 2025-09-24); cx22 left the API at the end of 2025, so
    it is neither listed nor accepted in a new server (docs.hetzner.cloud, "Deprecation")."""
    listed = {t["name"]: t for t in call(api, "GET", "/server_types").json()["server_types"]}
    assert "cx22" not in listed and {"cx23", "cx33", "ccx13"} <= set(listed)
    cx23 = listed["cx23"]
    assert {loc["name"] for loc in cx23["locations"]} == {"fsn1", "nbg1", "hel1"}
    assert all(loc["deprecation"] is None and loc["available"] for loc in cx23["locations"])
    assert call(api, "GET", "/server_types", params={"name": "cx22"}).json()["server_types"] == []
    refused = create(api, "old-type", server_type="cx22")
    assert refused.status_code == 422
    assert refused.json()["error"]["details"]["fields"][0]["name"] == "server_type"


def test_a_deprecated_type_is_listed_with_its_deprecation_until_it_is_gone(api: FakeHetzner) -> None:
    api.deprecate("cx33", location="hel1", unavailable_after=datetime.now(UTC) + timedelta(days=90))
    (cx33,) = call(api, "GET", "/server_types", params={"name": "cx33"}).json()["server_types"]
    hel1 = next(loc for loc in cx33["locations"] if loc["name"] == "hel1")
    assert set(hel1["deprecation"]) == {"announced", "unavailable_after"} and hel1["available"]
    assert create(api, "still-sold", server_type="cx33", location="hel1").status_code == 201

    api.deprecate("cx33", unavailable_after=datetime.now(UTC) - timedelta(seconds=1))
    assert call(api, "GET", "/server_types", params={"name": "cx33"}).json()["server_types"] == []
    assert create(api, "gone", server_type="cx33").status_code == 422


def test_images_leave_out_deprecated_ones_unless_asked_and_filter_by_architecture(api: FakeHetzner) -> None:
    images = call(api, "GET", "/images", params={"architecture": "x86"}).json()["images"]
    assert {i["name"] for i in images} >= {"ubuntu-24.04", "debian-12"}
    assert all(i["architecture"] == "x86" and i["deprecation"] is None for i in images)
    assert call(api, "GET", "/images", params={"architecture": "arm"}).json()["images"] == []
    locations = call(api, "GET", "/locations").json()["locations"]
    assert {loc["name"] for loc in locations} == {"fsn1", "nbg1", "hel1", "ash"}
