"""What constrained decoding costs on SmolLM2, and whether its replies validate (20 of 20).

    PYTHONPATH=src python benchmarks/serve/structured_decode.py [--replies 20] [--batch 4] [--json PATH]

The engine of `qkv serve` (the same continuous batch, no HTTP) runs `--replies` JSON-schema
requests, `--batch` at a time, sampled at temperature 0.7 with seeds 0.. (each row under its
own llguidance matcher), and checks every reply with jsonschema. Then it runs the same
prompts unconstrained, each cut at the length its constrained reply had, so both runs decode
the same number of tokens in the same batch shapes. The two runs alternate twice (ABBA:
qkv.bench.measure.timing's rotating rounds through benchmarks/harness.py's `alternate_own`);
reported: decode tokens/s of each (time after each request's first token), and the ratio of
their medians (of two runs: their means).
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from pathlib import Path

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402
from qkv.generation.constraints import Grammars, json_schema_grammar  # noqa: E402
from qkv.generation.sampling import Sampling  # noqa: E402
from qkv.serve.engine.jobs import Finished  # noqa: E402
from qkv.serve.http.server import load_served  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 30}, "member": {"type": "boolean"},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4}},
    "required": ["name", "age", "city", "member", "hobbies"], "additionalProperties": False}
QUESTION = ("Describe a person as JSON with the keys name, age, city, member (true or false) and "
            "hobbies (a list of strings).")


def run(served, prompt: list[int], seeds: list[int], batch: int, grammar: str | None,
        lengths: dict[int, int] | None) -> tuple[dict[int, list[int]], float, int]:
    """(replies per seed, decode seconds, decode tokens) of `seeds`, `batch` requests at a time."""
    grammars = getattr(served, "grammars", None)
    replies: dict[int, list[int]] = {}
    seconds, decode_tokens = 0.0, 0
    for start in range(0, len(seeds), batch):
        group = seeds[start:start + batch]
        done = threading.Event()
        spans: list[tuple[float, float, int]] = []
        left = [len(group)]
        lock = threading.Lock()

        def emitter(seed: int):
            out: list[int] = []
            stamps: list[float] = []

            def emit(item) -> None:
                if isinstance(item, Finished):
                    replies[seed] = out
                    spans.append((stamps[0], stamps[-1], len(out)))
                    with lock:
                        left[0] -= 1
                        if not left[0]:
                            done.set()
                elif not item.stop:
                    stamps.append(time.perf_counter())
                    out.append(item.id)
            return emit

        for seed in group:
            constraint = grammars.constraint(grammar) if grammar is not None else None
            max_tokens = lengths[seed] if lengths is not None else 256
            served.engine.submit(prompt, max_tokens=max_tokens, sampling=Sampling(temperature=0.7, seed=seed),
                                 stop_ids=served.stop_ids if grammar else frozenset(), emit=emitter(seed),
                                 constraint=constraint)
        assert done.wait(600)
        # Rows decode together: the group's wall time from its first token on, and every token after.
        seconds += max(b for _, b, _ in spans) - min(a for a, _, _ in spans)
        decode_tokens += sum(n for _, _, n in spans) - len(spans)
    return replies, seconds, decode_tokens


def main() -> None:
    parser = harness.parser(__doc__, json=True)
    parser.add_argument("--replies", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    facts = harness.header("constrained decoding on SmolLM2: replies that validate, and the cost", packages=("llguidance",))
    served = load_served("smollm2", max_batch=args.batch, capacity=512, prefix_reuse=False)
    served.grammars = Grammars(served.tokenizer, vocab_size=served.model.cfg.vocab_size, stop_ids=served.stop_ids)
    grammar = json_schema_grammar(PERSON)
    text = served.template.render([{"role": "user", "content": QUESTION}])
    prompt = served.tokenizer.encode(text, add_special_tokens=False).ids
    seeds = list(range(args.replies))
    served.engine.start()
    try:
        replies, _, _ = run(served, prompt, seeds, args.batch, grammar, None)  # warm-up and the lengths
        valid = 0
        for seed in seeds:
            try:
                jsonschema.validate(json.loads(served.tokenizer.decode(replies[seed])), PERSON)
                valid += 1
            except (json.JSONDecodeError, jsonschema.ValidationError) as error:
                print(f"seed {seed}: {type(error).__name__}: {str(error)[:120]}")
        lengths = {seed: len(r) for seed, r in replies.items()}

        def decoding(kind: str):
            def call() -> dict[str, float]:
                _, seconds, tokens = run(served, prompt, seeds, args.batch,
                                         grammar if kind == "constrained" else None, lengths)
                return {"tokens_per_s": tokens / seconds, "seconds": seconds, "tokens": tokens}
            return call

        # two rounds, who goes first rotating: constrained, free, free, constrained (ABBA)
        own = harness.alternate_own({kind: decoding(kind) for kind in ("constrained", "free")}, rounds=2)
        rates = {kind: list(samples["tokens_per_s"]) for kind, samples in own.items()}
    finally:
        served.engine.stop()
    print(f"SmolLM2, {args.replies} json_schema replies, {args.batch} rows at a time: {valid} of {args.replies} "
          f"parse and validate; mean reply {statistics.fmean(lengths.values()):.0f} tokens")
    print("example:", served.tokenizer.decode(replies[0]))
    for kind, values in rates.items():
        print(f"{kind:12s} decode tokens/s per run: " + ", ".join(f"{v:.1f}" for v in values))
    ratio = harness.median_ratio("constrained", rates["constrained"], "free", rates["free"])
    print(f"constrained / free: {ratio.value:.3f} (cost {100 * (1 - ratio.value):.1f}% of decode tokens/s)")
    if args.json:
        harness.write_json(args.json, {"replies": args.replies, "batch": args.batch, "valid": valid,
                                       "mean_reply_tokens": statistics.fmean(lengths.values()), "runs": own,
                                       "ratios": [ratio.to_dict()]}, facts)


if __name__ == "__main__":
    main()
