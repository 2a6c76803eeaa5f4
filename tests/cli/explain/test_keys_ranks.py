"""`qkv explain --keys --tensor-parallel N`: which rank holds which KV head, with the query heads
the model's attention groups with it, read from the description alone; N that does not
divide the KV heads is one line."""

from __future__ import annotations

import json
from pathlib import Path

from qkv.cli.main import main
from qkv.models.loader import load_pretrained
from tests.models.conftest import save_tiny


def test_each_rank_holds_whole_kv_heads_with_their_query_heads(tmp_path: Path, capsys) -> None:
    save_tiny("qwen2", tmp_path, hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    assert main(["explain", "--model", str(tmp_path), "--keys", "--tensor-parallel", "3", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    attention = next(load_pretrained(tmp_path)[0].attention_layers())
    assert got["layers"] == 2 and [r["rank"] for r in got["ranks"]] == [0, 1, 2]
    assert [h for r in got["ranks"] for h in r["kv_heads"]] == list(range(3))
    for rank in got["ranks"]:
        assert rank["query_heads"] == [q for g in rank["kv_heads"] for q in attention.query_heads_of(g)]
    assert main(["explain", "--model", str(tmp_path), "--keys", "--tensor-parallel", "3"]) == 0
    table = capsys.readouterr().out
    assert "over --tensor-parallel 3" in table and "KV heads" in table

    assert main(["explain", "--model", str(tmp_path), "--keys", "--tensor-parallel", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "choose --tensor-parallel 1, 3" in err
    assert main(["explain", "--model", str(tmp_path), "--tensor-parallel", "3"]) == 2
    assert "give it with --keys" in capsys.readouterr().err
