"""prefill: a long prompt through the model in one forward pass, qkv vs transformers,
float32, tokens/s; and the largest logit difference between them.

Shape legend: B batch (1), T prompt tokens.
"""

from __future__ import annotations

import torch

from qkv.bench.common import Context, Section
from qkv.bench.gpt2_checkpoint import load_hf, load_qkv
from qkv.bench.measure.timing import alternate, ratio


def prefill_section(ctx: Context) -> Section:
    s = ctx.sizes
    section = Section("prefill")
    folder = ctx.gpt2_checkpoint()
    ids = torch.randint(1, s.vocab, (1, s.prefill), generator=torch.Generator().manual_seed(2))  # (B, T)
    hf = load_hf(folder)
    ours = load_qkv(folder).model

    def run_hf() -> torch.Tensor:
        with torch.inference_mode():
            return hf(ids, use_cache=False).logits  # type: ignore[no-any-return]

    def run_qkv() -> torch.Tensor:
        with torch.inference_mode():
            return ours(ids)  # type: ignore[no-any-return]

    section.facts["max |logit difference| qkv vs transformers"] = (run_hf() - run_qkv()).abs().max().item()
    measured = alternate({"transformers float32": run_hf, "qkv float32": run_qkv},
                         work=s.prefill, unit="tokens", repeats=ctx.options.repeats)
    section.measurements.extend(measured.values())
    section.ratios.append(ratio(measured["qkv float32"], measured["transformers float32"]))
    section.facts["prompt tokens"] = s.prefill
    return section
