"""The explorer endpoint answers what qkv.trace records for the same selection."""

from __future__ import annotations

import httpx
import torch

from qkv.trace import trace
from qkv.trace.record.export import query_row

from tests.serve.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_trace_endpoint_equals_qkv_trace(server) -> None:
    text = "The cat sat on the mat"
    r = httpx.post(server.url + "/explorer/trace", headers=AUTH, timeout=60,
                   json={"text": text, "layer": 1, "head": 3, "query": 3, "generate": 3})
    assert r.status_code == 200, r.text
    data = r.json()
    served = server.served
    ids = served.tokenizer.encode(text).ids
    reference = served.engine.call(
        lambda: query_row(trace(served.model, torch.tensor([ids]), layer=[1], head=[3], query=[2]).layer(1),
                          None, 3, 2)).result(60)
    assert data["weights"] == reference["weights"] and data["scores"] == reference["scores"]
    assert data["query"]["position"] == 3  # positions count from 1, in and out
    assert data["context"] == reference["context"]
    assert data["num_layers"] == 2 and data["num_heads"] == 4 and len(data["tokens"]) == len(ids)
    assert [step["cached_keys"] for step in data["generation"]] == [len(ids), len(ids) + 1, len(ids) + 2]


def test_trace_errors_and_page(server) -> None:
    r = httpx.post(server.url + "/explorer/trace", headers=AUTH, json={"text": "cat", "layer": 9})
    assert r.status_code == 400 and "layer 9" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/explorer/trace", headers=AUTH, json={"text": 5})
    assert r.status_code == 400
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "textContent" in page.text and "innerHTML" not in page.text


def test_why_endpoint_equals_the_attribution_and_the_page_asks_for_it(server) -> None:
    from qkv.trace.explain.attribution import attribute

    text = "The cat sat on the mat"
    r = httpx.post(server.url + "/explorer/why", headers=AUTH, timeout=60,
                   json={"text": text, "layer": 1, "head": 3, "query": 5, "key": 2, "top": 5})  # from 1
    assert r.status_code == 200, r.text
    data = r.json()
    served = server.served
    ids = served.tokenizer.encode(text).ids
    reference = served.engine.call(
        lambda: attribute(served.model, torch.tensor([ids]), layer=1, head=3, query=4, keys=[1])).result(60)
    (key,) = data["keys"]
    assert key["score"] == float(reference.scores[0]) and key["position"] == 2
    assert [(p["query_source"], p["key_source"]) for p in key["top_pairs"]] == \
        [(q, k) for q, k, _ in reference.top_pairs(1, 5)]
    r = httpx.post(server.url + "/explorer/why", headers=AUTH, json={"text": text, "query": 2, "key": 4})
    assert r.status_code == 400 and "1 <= key <= query" in r.json()["error"]["message"]
    page = httpx.get(server.url + "/").text
    assert "/explorer/why" in page and page.count("</script>") == 1


def test_query_positions_count_from_1_in_and_out(server) -> None:
    text = "The cat sat on the mat because it was tired"
    count = len(server.served.tokenizer.encode(text).ids)
    r = httpx.post(server.url + "/explorer/trace", headers=AUTH, timeout=60, json={"text": text, "query": 7})
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["query"]["position"] == 7 and data["query"]["token"] == data["tokens"][6]
    assert data["visible"] == [True] * 7 + [False] * (count - 7)  # the causal mask: keys 1..7
    rope = data["analysis"]["rope"]
    assert rope["query_position"] == 7 and min(p["key_position"] for p in rope["pairs"]) == 1
    last = httpx.post(server.url + "/explorer/trace", headers=AUTH, timeout=60, json={"text": text}).json()
    assert last["query"]["position"] == count
    for wrong in (0, count + 1):
        r = httpx.post(server.url + "/explorer/trace", headers=AUTH, json={"text": text, "query": wrong})
        assert r.status_code == 400 and f"1..{count}" in r.json()["error"]["message"]
