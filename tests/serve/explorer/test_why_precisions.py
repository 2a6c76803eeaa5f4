"""The "why" click on a server that runs a quantized or bfloat16 model (SmolLM2's default is
int4): the split, labelled with what it is of and the served score beside it, or a 409 that
says what to do; never a 500."""

from __future__ import annotations

import copy

import pytest
import torch
from starlette.testclient import TestClient
from torch import nn

from qkv.runtime.linear.quantized import Int4Linear
from qkv.trace import trace

TEXT = "The cat sat on the mat"
WHY = {"text": TEXT, "layer": 1, "head": 3, "query": 5, "key": 2, "top": 5}  # positions from 1


def _client(folder, precision: str) -> tuple[TestClient, object]:
    from qkv.serve.http.app import build_app
    from qkv.serve.http.server import load_served

    served = load_served(str(folder), precision=precision, max_batch=1)
    return TestClient(build_app(served), base_url="http://127.0.0.1"), served


def _score(model: nn.Module, ids: list[int]) -> tuple[float, float]:
    focus = trace(model, torch.tensor([ids]), layer=[1], head=[3], query=[4]).layer(1)
    h, row = focus.head_slot(3), focus.query_slot(4)
    return float(focus.scores[0, h, row, 1]), float(focus.weights[0, h, row, 1])


def _float_copy(model: nn.Module) -> nn.Module:
    """The int4 model with each int4 layer replaced by an nn.Linear of the weights it stands for."""
    twin = copy.deepcopy(model)
    for parent in list(twin.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Int4Linear):
                linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                linear.weight.data = child.dequantized()
                if child.bias is not None:
                    linear.bias.data = child.bias.detach().float().clone()
                setattr(parent, name, linear)
    return twin


def test_why_on_int4_splits_the_float_weights_and_shows_the_served_score(tiny_folder) -> None:
    client, served = _client(tiny_folder, "int4")
    with client:
        r = client.post("/explorer/why", json=WHY)
        assert r.status_code == 200, r.text
        data = r.json()
        ids = served.tokenizer.encode(TEXT).ids
        served_score, served_weight = served.engine.call(lambda: _score(served.model, ids)).result(60)
        float_score, _ = served.engine.call(lambda: _score(_float_copy(served.model), ids)).result(60)
    (key,) = data["keys"]
    assert data["split_of"] == "float weights" and data["served"]["precision"] == "int4"
    assert data["served"]["score"] == served_score and data["served"]["weight"] == served_weight
    assert key["score"] == pytest.approx(float_score, abs=1e-5)  # the float model of the same weights
    assert key["sum_of_terms"] == pytest.approx(key["score"], abs=1e-5)  # and its split adds up
    assert abs(served_score - float_score) > 1e-4  # int4's rounding: what no split follows


def test_why_on_int8_is_the_served_models_own_split(tiny_folder) -> None:
    client, _ = _client(tiny_folder, "int8")
    with client:
        data = client.post("/explorer/why", json=WHY).json()
    (key,) = data["keys"]
    assert data["split_of"] == "served" and data["served"]["score"] == key["score"]
    assert key["sum_of_terms"] == pytest.approx(key["score"], abs=1e-5)


def test_why_on_bfloat16_is_a_409_that_says_what_to_do(tiny_folder) -> None:
    client, _ = _client(tiny_folder, "bfloat16")
    with client:
        r = client.post("/explorer/why", json=WHY)
        page = client.get("/").text
    assert r.status_code == 409 and "--dtype float32" in r.json()["error"]["message"]
    assert "Click a key's row" in page and "clickable" in page
