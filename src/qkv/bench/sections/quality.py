"""quality: the perplexity cost of each precision, with the one perplexity
(`qkv.eval.perplexity.perplexity`, windows as `qkv perplexity` lays them by default: the
model's context up to 1024 tokens, stride half of it) on the text given with --data,
for float32, bfloat16, int8 and int4, each as a ratio to bfloat16's. SmolLM2 at FULL
sizes; the run's random GPT-2 at QUICK sizes (numbers without meaning, every code path).
"""

from __future__ import annotations

import torch

from qkv.bench.common import Context, Section
from qkv.runtime.prepare import load_for_generation
from qkv.eval.perplexity import perplexity
from qkv.names import PRECISIONS
from qkv.util.text_file import read_text_file

CONTEXT_CAP = 1024  # as `qkv perplexity` caps its default window
BASE = "bfloat16"


def quality_section(ctx: Context) -> Section:
    section = Section("quality")
    data = ctx.options.data
    if data is None:
        section.skipped.append("quality: skipped (no --data FILE given: the text to score, "
                               "e.g. the book's short story the-verdict.txt)")
        return section
    text = read_text_file(data, when_empty="is empty; give --data a text to score")
    source = "smollm2" if ctx.sizes.quality_model == "smollm2" else ctx.gpt2_checkpoint()
    scores: dict[str, float] = {}
    for precision in PRECISIONS:
        ctx.progress(f"perplexity, {precision}")
        model, tokenizer, _ = load_for_generation(source, precision=precision, compile=False)
        ids = torch.tensor(tokenizer.encode(text).ids)  # (N,)
        if ctx.sizes.quality_tokens:
            ids = ids[: ctx.sizes.quality_tokens]
        context_length = min(model.context_length, CONTEXT_CAP)
        result = perplexity(model, ids, context_length=context_length, stride=max(1, context_length // 2))
        scores[precision] = result.perplexity
        section.facts["tokens scored"] = result.tokens
        section.facts["window, stride"] = [context_length, max(1, context_length // 2)]
        del model
    section.facts["model"] = "SmolLM2-135M-Instruct (GGUF)" if source == "smollm2" else "random GPT-2 (quick sizes)"
    section.facts["data"] = str(data)
    section.facts["perplexity"] = {name: round(value, 4) for name, value in scores.items()}
    section.facts[f"perplexity / {BASE}"] = {name: round(value / scores[BASE], 5) for name, value in scores.items()}
    return section
