"""`qkv bench --quick`: the sections run end to end at tiny sizes, the JSON has the
promised shape, and every ratio is the one its measured medians give. No timing is
asserted."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from qkv.cli.main import main

pytest.importorskip("transformers")


def check_ratios(section: dict) -> None:
    by_name = {m["name"]: m for m in section["measurements"]}
    for m in section["measurements"]:
        assert len(m["samples_s"]) >= 5
        assert m["median_s"] == statistics.median(m["samples_s"])
        assert m["rate"] == pytest.approx(m["work"] / m["median_s"], rel=1e-12)
    for r in section["ratios"]:
        of, over = by_name[r["of"]], by_name[r["over"]]
        assert r["value"] == pytest.approx(of["rate"] / over["rate"], rel=1e-12)


@pytest.mark.slow
def test_quick_bench_writes_consistent_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "context.png"
    code = main(["bench", "--quick", "--threads", "1", "--json", str(out), "--plot", str(png),
                 "--only", "decode,roofline,prefill", "--only", "cache,attention,kv_bytes,plot"])
    assert code == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["schema"] == "qkv-bench/2" and report["quick"] and report["repeats"] == 5
    assert report["complete"] is True
    assert list(report["sections"]) == ["decode", "roofline", "prefill", "cache", "kv_bytes", "attention", "plot"]
    for name, section in report["sections"].items():
        assert f"### {name}" in printed
        check_ratios(section)
    decode = report["sections"]["decode"]
    assert {r["over"] for r in decode["ratios"]} == {"transformers float32", "qkv float32 --no-compile"}
    for name in ("qkv float32 (default flags: compiled)", "qkv float32 --no-compile"):
        assert decode["facts"][f"{name}: greedy tokens equal to transformers"] == 1.0
    assert report["sections"]["cache"]["facts"]["greedy tokens equal with and without cache"] is True
    roof = report["sections"]["roofline"]["facts"]["qkv float32 (default flags: compiled)"]
    per_run = roof["fraction of roofline per run"]
    assert len(per_run) == 5 and all(f > 0 for f in per_run)
    assert roof["fraction of roofline (median over runs)"] == pytest.approx(statistics.median(per_run), abs=1e-4)
    # The bound is the bandwidth read next to each run over the bytes a token reads.
    bytes_per_token = roof["weight bytes per token"] + roof["kv bytes per token"]
    assert roof["roofline tokens/s (median)"] == pytest.approx(
        roof["read bandwidth GB/s just before and after each run (median)"] * 1e9 / bytes_per_token, rel=1e-2)
    kv = report["sections"]["kv_bytes"]["facts"]
    assert all(row["bytes per token"] == row["formula 2*layers*kv_heads*head_dim*4"] for row in kv.values())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quality_without_data_says_it_is_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "q.json"
    assert main(["bench", "--quick", "--only", "quality", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["complete"] is True
    skipped = report["sections"]["quality"]["skipped"]
    assert len(skipped) == 1 and "--data" in skipped[0]
    assert "quality: skipped" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_quality_scores_every_precision(tmp_path: Path) -> None:
    text = tmp_path / "story.txt"
    text.write_text("the key the key of the story " * 40, encoding="utf-8")
    out = tmp_path / "q.json"
    assert main(["bench", "--quick", "--only", "quality", "--data", str(text), "--json", str(out)]) == 0
    facts = json.loads(out.read_text())["sections"]["quality"]["facts"]
    assert list(facts["perplexity"]) == ["float32", "bfloat16", "int8", "int4"]
    assert facts["perplexity / bfloat16"]["bfloat16"] == 1.0
    assert all(value > 1.0 for value in facts["perplexity"].values())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--repeats", "3"], "at least 5"),
        (["--only", "decode,warp"], "unknown section warp"),
        (["--json", "/nonexistent-folder/x.json"], "does not exist"),
        (["--threads", "0"], "at least 1"),
        (["--only", "quality", "--data", "/nonexistent-folder/story.txt"], "does not exist"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_help_imports_no_torch() -> None:
    code = ("import sys\nfrom qkv.cli.main import main\ntry:\n    main(['bench', '--help'])\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "False"
    assert "--data" in done.stdout and "smollm2" in done.stdout


def test_quick_kv_cache_section_is_consistent(tmp_path: Path) -> None:
    """Every part of the kv-cache section runs (tiny model); ratios come from the same run's
    medians, and the streaming slices cover the tokens scored."""
    out = tmp_path / "kv.json"
    assert main(["bench", "--quick", "--threads", "1", "--only", "kv-cache", "--json", str(out)]) == 0
    section = json.loads(out.read_text())["sections"]["kv-cache"]
    rates = {m["name"]: m["rate"] for m in section["measurements"]}
    (r,) = section["ratios"]
    assert r["value"] == pytest.approx(rates["int4 cache"] / rates["full cache"])
    facts = section["facts"]
    (scored,) = facts["perplexity through each cache"].values()
    assert scored["kinds"]["full"]["vs full"] == 0 and len(scored["kinds"]) == 7
    stream = facts["streaming past the context"]
    assert stream["tokens"] > 2 * stream["context length"]
    assert len(stream["loss per slice"]) == -(-stream["tokens"] // stream["slice tokens"])
    per_token = facts["bytes per token (bfloat16)"]
    assert per_token["full"]["smaller than bfloat16"] == 1
    assert per_token["int2"]["bytes"] < per_token["int4"]["bytes"] < per_token["full"]["bytes"]
