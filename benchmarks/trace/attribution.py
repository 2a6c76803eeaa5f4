"""Issue 27 on real SmolLM2-135M: how fast the exact split is, what carries the sink, and which
keys the prediction depends on in a copying example.

    .venv/bin/python benchmarks/trace/attribution.py --threads 2 --rounds 5 --json attribution.json

1. Speed: one head's full attribution of one query row (every key) at the first, middle and
   last layer, from the forward that records the sources to the checked split; median of
   `--rounds` runs (--repeats: the same), next to the plain forward of the same text in the
   same rounds, who goes first rotating (benchmarks/harness.py: qkv.bench.measure.timing's
   `alternate`, no warm-up round).
2. The sink: for the five heads with the most sink mass, the share of the first key's mean
   score held by its three largest (query source x key source) terms.
3. Copying: "Anna lives in Paris. ... The capital of France is": a patch sweep over every
   layer and position with the same text naming Rome instead of Paris as the donor, and
   one with mean keys; the positions whose patch moves the prediction most.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402
import qkv  # noqa: E402
from qkv.trace.explain.attribution import attribute_recorded, record_forward  # noqa: E402
from qkv.trace.explain.patching import patch_sweep  # noqa: E402
from qkv.trace.explain.sink import explain_sinks  # noqa: E402

SINK_TEXT = (
    "I had always thought Jack Gisburn rather a cheap genius--though a good fellow enough--so it "
    "was no great surprise to me to hear that, in the height of his glory, he had dropped his "
    "painting, married a rich widow, and established himself in a villa on the Riviera."
)
COPY_TEXT = "Anna lives in Paris. She loves the city. The capital of France is"
COPY_DONOR = "Anna lives in Rome. She loves the city. The capital of France is"


def _speed(model, ids, repeats: int) -> dict:
    t = ids.shape[1]
    terms: dict[str, list[float]] = {}

    def forward() -> None:
        with torch.no_grad():
            model(ids)

    def attribution(layer: int):
        def run() -> None:
            record = record_forward(model, ids, layers=[layer], queries=[t - 1])
            result = attribute_recorded(record, layer=layer, head=4, query=t - 1)
            terms.setdefault(f"layer {layer} terms", []).append(float(result.pairs.numel()))
        return run

    measured = harness.alternate({"forward": forward, **{f"layer {layer}": attribution(layer) for layer in (0, 15, 29)}},
                                 work=1, unit="rows", repeats=repeats, warmup=0)
    return {**{name: m.median_s for name, m in measured.items()},
            **{name: harness.median(values) for name, values in terms.items()}}


def _named(tokens: list[str], cells) -> list[dict]:
    return [{"layer": l, "position": p + 1, "token": tokens[p], "kl": round(kl, 4)} for l, p, kl in cells]


def main() -> None:
    parser = harness.parser(__doc__, rounds=5, rounds_aliases=("--repeats",), threads=2, json=True)
    parser.add_argument("--parts", default="speed,sinks,sweeps",
                        help="comma-separated: speed, sinks, sweeps (default: all three)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    unknown = parts - {"speed", "sinks", "sweeps"}
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from speed, sinks, sweeps")
    torch.set_num_threads(args.threads)
    facts = harness.header("exact score attribution and key patching on SmolLM2")
    model, tokenizer = qkv.load_pretrained("smollm2")
    out: dict = {"threads": args.threads}

    ids = torch.tensor([tokenizer.encode(SINK_TEXT).ids])
    out["tokens"] = int(ids.shape[1])
    if "speed" in parts:
        out["speed_s"] = _speed(model, ids, args.rounds)
        print("speed (median s):", json.dumps(out["speed_s"]), flush=True)
    if "sinks" in parts:
        _sinks(model, ids, out)
    if "sweeps" in parts:
        _sweeps(model, tokenizer, out)
    if args.json:
        harness.write_json(args.json, out, facts)


def _sinks(model, ids, out: dict) -> None:
    sinks = explain_sinks(model, ids, count=5)
    out["sinks"] = [{"layer": s.layer, "head": s.head, "sink_mass": round(s.sink_mass, 4),
                     "score": round(s.score, 3), "top3_share_of_score": round(s.top_share(3), 4),
                     "top3_share_of_term_sizes": round(s.top_size_share(3), 4),
                     "top3": [(q, k, round(t, 3)) for q, k, t in s.top_pairs(3)],
                     "key_source_1": s.key_totals()[0]} for s in sinks]
    for s in out["sinks"]:
        print("sink:", json.dumps(s), flush=True)


def _sweeps(model, tokenizer, out: dict) -> None:
    ids = torch.tensor([tokenizer.encode(COPY_TEXT).ids])
    donor = torch.tensor([tokenizer.encode(COPY_DONOR).ids])
    tokens = [tokenizer.decode([i]) for i in ids[0].tolist()]
    for name, donor_ids in (("donor Rome", donor), ("mean keys", None)):
        start = time.perf_counter()
        sweep = patch_sweep(model, ids, layers=range(30), donor_ids=donor_ids)
        seconds = time.perf_counter() - start
        by_position = [max(row.kl[p] for row in sweep.rows) for p in range(ids.shape[1])]
        out[f"sweep, {name}"] = {
            "prediction": tokenizer.decode([sweep.top_token]), "probability": round(sweep.top_probability, 4),
            "strongest": _named(tokens, sweep.strongest(6)), "seconds": round(seconds, 1),
            "largest KL per position": {f"{p + 1} {tokens[p]!r}": round(v, 4) for p, v in enumerate(by_position)},
        }
        print(f"sweep, {name}:", json.dumps(out[f"sweep, {name}"]), flush=True)


if __name__ == "__main__":
    main()
