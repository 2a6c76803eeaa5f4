"""What issue 28's trust boundaries cost: content keys, template rendering in a child, and the
tokenizer guard. Medians of repeated runs, each pair measured in the same run, alternating
round by round (benchmarks/harness.py: qkv.bench.measure.timing's `alternate`).

    python benchmarks/gguf/trust_boundaries.py [--big-file-gb 1] [--json PATH]

- content_digest (full SHA-256) of SmolLM2's GGUF and of a 1 GB file, against the path +
  size + mtime key it replaces, and against the preparation time a cache hit saves;
- one chat-template render (SmolLM2's template, a 3-message conversation) in-process and in
  qkv.chat.template_process's child, and the child's start;
- encoding a 100 KB and a 1 MB text with and without the tokenizer guard (SmolLM2's
  tokenizer: no normalizer, the fast path; a Llama-2-style normalizer: the measured path).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

MEASURED: dict[str, dict] = {}  # what --json writes: every pair's measurements


def medians(label: str, contenders: dict[str, Callable[[], object]], repeats: int) -> list[float]:
    """Median seconds of each contender, alternating round by round, in the order given."""
    measured = harness.alternate(contenders, work=1, unit="calls", repeats=repeats, warmup=0)
    MEASURED[label] = harness.summary(measured.values())
    return [m.median_s for m in measured.values()]


def hashing(big_gb: float) -> None:
    from qkv.util.cache_integrity import content_digest
    from qkv.models.loader import smollm2_path

    gguf = smollm2_path()
    content_digest([gguf])  # in the page cache, as it is when qkv has just opened it
    stat_key, = medians("path+size+mtime key", {"stat key": lambda: [os.stat(gguf).st_mtime_ns, str(gguf.resolve())]},
                        50)
    full, = medians("SmolLM2 GGUF SHA-256", {"content_digest": lambda: content_digest([gguf])}, 5)
    size = gguf.stat().st_size
    print(f"SmolLM2 GGUF ({size / 2**20:.0f} MiB): full SHA-256 {full * 1e3:.0f} ms "
          f"({size / full / 2**30:.2f} GiB/s); path+size+mtime key {stat_key * 1e6:.0f} us")
    with tempfile.TemporaryDirectory() as folder:
        big = Path(folder) / "big.bin"
        with open(big, "wb") as handle:
            block = os.urandom(1 << 20)
            for _ in range(int(big_gb * 1024)):
                handle.write(block)
        content_digest([big])
        full_big, one_thread = medians(f"{big_gb:g} GiB SHA-256", {
            "threads": lambda: content_digest([big]), "one thread": lambda: content_digest([big], threads=1)}, 3)
        print(f"{big_gb:g} GiB file: full SHA-256 {full_big:.2f} s with {min(8, os.cpu_count() or 1)} threads "
              f"({big_gb / full_big:.2f} GiB/s), {one_thread:.2f} s with one")


def templates() -> None:
    from qkv.chat.conversation import ChatTemplate
    from qkv.models.gguf.checkpoint import open_gguf_file
    from qkv.models.loader import smollm2_path
    from qkv.chat.sandbox import chat_environment, render
    from qkv.chat.template_process import TemplateProcess

    source = open_gguf_file(smollm2_path()).chat_template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a key?"},
                {"role": "assistant", "content": "The vector a token offers to queries."}]
    variables = {"messages": messages, "add_generation_prompt": True, "bos_token": "", "eos_token": ""}
    compiled = chat_environment().bounded_template(source)
    child = TemplateProcess()
    start = time.perf_counter()
    child.check(source)
    started = time.perf_counter() - start
    inside, outside = medians("chat template render", {
        "in-process": lambda: render(compiled, **variables), "child": lambda: child.render(source, variables)}, 200)
    child.close()
    ChatTemplate(source).render(messages)  # the path qkv takes
    print(f"SmolLM2 chat template: in-process {inside * 1e3:.3f} ms a render, child {outside * 1e3:.3f} ms "
          f"({outside / inside:.1f}x); the child starts in {started * 1e3:.0f} ms (once per process)")


def tokenizers() -> None:
    from tokenizers import normalizers

    from qkv.models.gguf.checkpoint import open_gguf_file
    from qkv.models.loader import smollm2_path
    from qkv.models.hf.tokenizer_guard import guard

    guarded = open_gguf_file(smollm2_path()).tokenizer
    plain = guarded.inner
    llama2 = guard(_with_normalizer(plain, normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])), "llama2-style")
    text = (Path(__file__).resolve().parents[2] / "shared" / "data" / "the-verdict.txt")
    base = text.read_text(encoding="utf-8") if text.is_file() else "Your journey starts with one step. " * 1000
    for size in (100_000, 1_000_000):
        sample = (base * (size // len(base) + 1))[:size]
        bare, bounded = medians(f"SmolLM2 encode {size}", {
            "bare": lambda: plain.encode(sample), "guarded": lambda: guarded.encode(sample)}, 5)
        measured_inner = llama2.inner
        bare_l, bounded_l = medians(f"Llama-2-style encode {size}", {
            "bare": lambda: measured_inner.encode(sample), "guarded": lambda: llama2.encode(sample)}, 5)
        print(f"encode {size / 1e3:.0f} KB: SmolLM2 {bare * 1e3:.0f} ms bare, {bounded * 1e3:.0f} ms guarded "
              f"({bounded / bare:.2f}x); Llama-2-style normalizer {bare_l * 1e3:.0f} ms bare, "
              f"{bounded_l * 1e3:.0f} ms guarded ({bounded_l / bare_l:.2f}x)")


def _with_normalizer(tokenizer, normalizer):
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.normalizer = normalizer
    return copy


def main() -> None:
    parser = harness.parser(__doc__, json=True)
    parser.add_argument("--big-file-gb", type=float, default=1.0)
    args = parser.parse_args()
    facts = harness.header("what issue 28's trust boundaries cost", packages=("tokenizers",))
    hashing(args.big_file_gb)
    templates()
    tokenizers()
    if args.json:
        harness.write_json(args.json, {"big_file_gb": args.big_file_gb, "pairs": MEASURED}, facts)


if __name__ == "__main__":
    main()
