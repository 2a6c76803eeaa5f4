"""Per-token cost of a JSON-schema token mask on this CPU: llguidance, xgrammar, outlines-core.

Each library compiles one schema for SmolLM2's tokenizer (49,152 tokens), then walks the
tokens of one valid document: at every step it computes the mask of allowed tokens into a
bitmask (what a server must do before it samples), the step's token is checked to be
allowed, and consumed. Reported: compile time and the median / p90 mask time per token.
Also the cost of applying the bitmask to a (1, V) logits row with torch, which every
library needs in the same way. The libraries walk one after the other (each its own
matcher's states, so a token at a time cannot alternate between them); medians are
benchmarks/harness.py's Measurements of the per-token samples.

    PYTHONPATH=src python benchmarks/serve/grammar_mask.py [--xgrammar-path /tmp/xg] [--json PATH]

xgrammar pulls triton (a GPU compiler) as a dependency: install it aside for this
measurement with `pip install --no-deps --target /tmp/xg xgrammar apache-tvm-ffi`.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "city", "tags", "score"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({"name": "Ada Lovelace, the first programmer", "age": 36, "city": "Paris",
                       "tags": ["math", "engines", "poetry of science"], "score": 9.75})


def byte_level_tokens(tokenizer) -> dict[bytes, list[int]]:  # noqa: ANN001
    """Each token's bytes (GPT-2 byte-level alphabet decoded), for outlines-core."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):  # GPT-2's bytes_to_unicode: unprintable bytes map to 256, 257, ...
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    to_byte = {chr(c): b for b, c in zip(printable, chars)}
    table: dict[bytes, list[int]] = {}
    for token_id in range(tokenizer.get_vocab_size()):
        text = tokenizer.id_to_token(token_id)
        if text is None:
            continue
        raw = bytes(to_byte[ch] for ch in text) if all(ch in to_byte for ch in text) else text.encode()
        table.setdefault(raw, []).append(token_id)
    return table


def walk(name: str, compile_: Callable[[], object], fill: Callable[[object, torch.Tensor], None],
         allowed: Callable[[torch.Tensor, int], bool], accept: Callable[[object, int], None],
         ids: list[int], vocab: int) -> dict[str, float]:
    start = time.perf_counter()
    state = compile_()
    compiled = time.perf_counter() - start
    mask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    times = []
    for token in ids:
        begin = time.perf_counter()
        fill(state, mask)
        times.append(time.perf_counter() - begin)
        if not allowed(mask, token):
            raise SystemExit(f"{name}: token {token} of the document was masked out")
        accept(state, token)
    per_token = harness.Measurement(name, 1, "masks", tuple(times))
    times.sort()
    return {"compile_ms": compiled * 1e3, "median_us": per_token.median_s * 1e6,
            "p90_us": times[int(0.9 * len(times))] * 1e6,
            "mean_us": statistics.fmean(times) * 1e6, "tokens": len(ids)}


def bit_allowed(mask: torch.Tensor, token: int) -> bool:
    return bool((int(mask[0, token // 32]) >> (token % 32)) & 1)


def main() -> None:
    parser = harness.parser(__doc__, json=True)
    parser.add_argument("--xgrammar-path", default="/tmp/xg")
    args = parser.parse_args()
    facts = harness.header("a JSON-schema token mask per token: llguidance, outlines-core, xgrammar",
                           packages=("llguidance", "outlines_core", "xgrammar"))
    from qkv.models.loader import open_model

    opened = open_model("smollm2")
    tokenizer = opened.source.tokenizer
    vocab = opened.plan.config["vocab_size"]
    eos = tokenizer.token_to_id("<|im_end|>")
    ids = tokenizer.encode(DOCUMENT, add_special_tokens=False).ids
    results: dict[str, dict[str, float]] = {}

    import llguidance
    import llguidance.torch as lt

    begin = time.perf_counter()
    ll_tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab, eos_token=eos)
    print(f"llguidance tokenizer tables: {(time.perf_counter() - begin) * 1e3:.0f} ms (once per model)")
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    results["llguidance " + llguidance.get_version() if hasattr(llguidance, "get_version") else "llguidance"] = walk(
        "llguidance", lambda: llguidance.LLMatcher(ll_tokenizer, grammar),
        lambda m, mask: lt.fill_next_token_bitmask(m, mask, 0), bit_allowed,
        lambda m, t: m.consume_token(t), ids, vocab)

    import outlines_core

    table = byte_level_tokens(tokenizer)
    table.pop(b"<|im_end|>", None)
    vocabulary = outlines_core.Vocabulary(eos, table)
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    results["outlines-core"] = walk(
        "outlines-core", lambda: outlines_core.Guide(outlines_core.Index(regex, vocabulary)),
        lambda g, mask: g.write_mask_into(mask.data_ptr(), mask.numel(), 4), bit_allowed,
        lambda g, t: g.advance(t), ids, vocab)

    sys.path.insert(0, args.xgrammar_path)
    try:
        import transformers
        import xgrammar

        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
        compiler = xgrammar.GrammarCompiler(info)
        results["xgrammar"] = walk(
            "xgrammar", lambda: xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA))),
            lambda m, mask: m.fill_next_token_bitmask(mask, 0), bit_allowed,
            lambda m, t: m.accept_token(t), ids, vocab)
    except ImportError as error:
        print(f"xgrammar not measured: {error}")

    logits = torch.randn(1, vocab)
    mask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    from qkv.generation.constraints import apply_bitmask

    def masked() -> float:
        row = logits.clone()  # not timed: each call masks a fresh row
        begin = time.perf_counter()
        apply_bitmask(row, mask[0])
        return time.perf_counter() - begin

    applied = harness.self_timed({"apply_bitmask": masked}, work=1, unit="rows", rounds=200)["apply_bitmask"]
    print(f"SmolLM2 vocabulary {vocab}, document of {len(ids)} tokens")
    for name, r in results.items():
        print(f"{name:16s} compile {r['compile_ms']:8.1f} ms   mask per token median {r['median_us']:8.1f} us"
              f"  p90 {r['p90_us']:8.1f} us  mean {r['mean_us']:8.1f} us")
    print(f"apply a bitmask to one (V,) row (qkv.generation.constraints.apply_bitmask): median "
          f"{applied.median_s * 1e6:.1f} us")
    if args.json:
        harness.write_json(args.json, {"vocabulary": vocab, "document_tokens": len(ids), "libraries": results,
                                       "apply_bitmask": applied.to_dict()}, facts)


if __name__ == "__main__":
    main()
