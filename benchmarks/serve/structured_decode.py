"""What constrained decoding costs on SmolLM2, and whether its replies validate (20 of 20).

    PYTHONPATH=src python benchmarks/structured_decode.py [--replies 20] [--batch 4]

The engine of `qkv serve` (the same continuous batch, no HTTP) runs `--replies` JSON-schema
requests, `--batch` at a time, sampled at temperature 0.7 with seeds 0.. (each row under its
own llguidance matcher), and checks every reply with jsonschema. Then it runs the same
prompts unconstrained, each cut at the length its constrained reply had, so both runs decode
the same number of tokens in the same batch shapes. The two runs alternate twice (ABBA);
reported: decode tokens/s of each (time after each request's first token), and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import jsonschema

from qkv.generation.constraints import Grammars, json_schema_grammar
from qkv.generation.sampling import Sampling
from qkv.serve.engine.batching import Finished
from qkv.serve.http.server import load_served

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
    parser = argparse.ArgumentParser()
    parser.add_argument("--replies", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
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
        rates: dict[str, list[float]] = {"constrained": [], "free": []}
        for order in (("constrained", "free"), ("free", "constrained")):
            for kind in order:
                _, seconds, tokens = run(served, prompt, seeds, args.batch, grammar if kind == "constrained" else None,
                                         lengths)
                rates[kind].append(tokens / seconds)
    finally:
        served.engine.stop()
    print(f"SmolLM2, {args.replies} json_schema replies, {args.batch} rows at a time: {valid} of {args.replies} "
          f"parse and validate; mean reply {statistics.fmean(lengths.values()):.0f} tokens")
    print("example:", served.tokenizer.decode(replies[0]))
    for kind, values in rates.items():
        print(f"{kind:12s} decode tokens/s per run: " + ", ".join(f"{v:.1f}" for v in values))
    ratio = statistics.fmean(rates["constrained"]) / statistics.fmean(rates["free"])
    print(f"constrained / free: {ratio:.3f} (cost {100 * (1 - ratio):.1f}% of decode tokens/s)")


if __name__ == "__main__":
    main()
