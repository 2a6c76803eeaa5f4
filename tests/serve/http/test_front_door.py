"""The front door's parts: Host header parsing, the names a server answers to, content types,
and the metrics page's labels and escaping (read back by prometheus_client's parser, the
reference for the Prometheus text format)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from qkv.serve.engine.stats import EngineStats
from qkv.serve.http.front_door import Door, host_part, json_type_problem
from qkv.serve.http.metrics import MODEL_ROUTE, OTHER, ROUTES, Metrics, escape_label, route_label


@pytest.mark.parametrize(("header", "name"), [
    ("127.0.0.1:8000", "127.0.0.1"), ("LocalHost", "localhost"), ("[::1]:8000", "[::1]"), ("[::1]", "[::1]"),
    ("example.com", "example.com"), ("a:b", None), ("[::1", None), ("[::1]x", None), (":80", None), ("", None),
    ("h:80:1", None),
])
def test_host_part(header: str, name: str | None) -> None:
    assert host_part(header) == name


def test_a_server_answers_to_its_loopback_names_its_host_and_the_allowed_ones() -> None:
    assert Door().host_names() == {"127.0.0.1", "localhost", "[::1]"}
    assert Door(host="::1").host_names() == {"127.0.0.1", "localhost", "[::1]"}
    named = Door(host="Box.lan", allowed_hosts=("qkv.example", "fd00::5")).host_names()
    assert {"box.lan", "qkv.example", "[fd00::5]"} <= named
    assert Door(host="0.0.0.0").host_names() == {"127.0.0.1", "localhost", "[::1]"}  # plus IP literals


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "APPLICATION/JSON;charset=\"UTF-8\"", "application/json; foo=bar"])
def test_json_content_types_pass(content_type: str) -> None:
    assert json_type_problem(content_type) is None


@pytest.mark.parametrize("content_type", [None, "", "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/json; charset=utf-16",
                                          "application/jsonx", "text/json"])
def test_other_content_types_are_refused(content_type: str | None) -> None:
    assert json_type_problem(content_type)


def test_route_labels_are_a_fixed_set() -> None:
    assert {route_label(path) for path in ROUTES} == ROUTES
    assert route_label("/v1/models/anything/else") == MODEL_ROUTE
    for path in ("/v1/model", "/metrics/", "/x", "/v1/completions/x", "//health", ""):
        assert route_label(path) == OTHER


@given(st.text(max_size=40))
def test_escaped_labels_read_back_as_the_same_text(value: str) -> None:
    page = f'qkv_probe_total{{path="{escape_label(value)}"}} 1\n'
    [family] = text_string_to_metric_families(page)
    assert family.samples[0].labels["path"] == value


@given(st.lists(st.text(max_size=30), max_size=50))
def test_any_paths_give_a_parseable_page_with_bounded_labels(paths: list[str]) -> None:
    metrics = Metrics()
    for path in paths:
        metrics.count(path, 404)
    page = metrics.render(EngineStats(slots=2))
    samples = [s for family in text_string_to_metric_families(page) for s in family.samples
               if s.name == "qkv_requests_total"]
    assert {s.labels["path"] for s in samples} <= ROUTES | {MODEL_ROUTE, OTHER}
    assert sum(s.value for s in samples) == len(paths)


def test_an_uncaught_panic_is_a_json_500() -> None:
    from starlette.applications import Starlette
    from starlette.routing import Route
    from starlette.testclient import TestClient
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    from qkv.serve.http.front_door import front_door

    panicking = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    panicking.pre_tokenizer = pre_tokenizers.Split(Regex("(a|aa)+$"), behavior="isolated")

    async def route(request):  # a pyo3 PanicException is a BaseException: Starlette lets it through
        panicking.encode("a" * 40 + "!")

    metrics = Metrics()
    app = front_door(Starlette(routes=[Route("/health", route)]), Door(allowed_hosts=("testserver",)), metrics)
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.get("/health")
        refused = client.get("/health", headers={"Host": "evil.example"})
    assert r.status_code == 500 and "PanicException" in r.json()["error"]["message"]
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_host"
    assert metrics.requests[("/health", 500)] == 1 and metrics.requests[("/health", 400)] == 1
