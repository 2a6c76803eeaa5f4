"""`qkv explain --model M --keys`: the anatomy of a model's keys, as a table or JSON, and with
--png DIR / --html FILE as figures and a self-contained page (qkv.trace.render.keys_figures)."""

from __future__ import annotations

import argparse
import json
import sys

import torch
from rich.console import Console

from qkv.errors import QkvError

DEFAULT_TEXT = (
    "I had always thought Jack Gisburn rather a cheap genius--though a good fellow enough--so it "
    "was no great surprise to me to hear that, in the height of his glory, he had dropped his "
    "painting, married a rich widow, and established himself in a villa on the Riviera."
)


def run_keys(args: argparse.Namespace) -> int:
    from qkv.cli.explain.model import load_model
    from qkv.trace.explain.keys import by_attention, key_anatomy, summary_rows

    if args.generate is not None:
        raise QkvError("--keys measures the keys of a text; drop --generate")
    if args.tensor_parallel is not None:
        return run_key_ranks(args)
    text = args.text if args.text is not None else DEFAULT_TEXT
    if not text.strip():
        raise QkvError("the text is empty: give some words, or none for the default passage")
    loaded = load_model(args.model, max_memory=args.max_memory)
    if loaded.encoder:
        raise QkvError(f"--keys measures decoders' keys; {loaded.name} is an encoder (BERT)")
    ids = list(loaded.tokenizer.encode(text).ids)
    context_length = int(getattr(loaded.model, "context_length", len(ids)))
    if len(ids) < 2 or len(ids) > context_length:
        raise QkvError(f"the text has {len(ids)} tokens; give between 2 and {context_length}")
    anatomy = key_anatomy(loaded.model, torch.tensor([ids]), name=loaded.name)
    rows = summary_rows(anatomy)
    if args.layer is not None:
        layers = {row["layer"] for row in rows}
        if args.layer not in layers:
            raise QkvError(f"--layer {args.layer}: {loaded.name} has layers 0 to {max(layers)}")
        anatomy.heads = [h for h in anatomy.heads if h.layer == args.layer]
        rows = [r for r in rows if r["layer"] == args.layer]
    console = Console(highlight=False)
    if args.png is not None or args.html is not None:
        _write_figures(args, anatomy, rows, console)
    if args.json:
        json.dump(anatomy.to_json() | {"summary": rows, "by_attention": by_attention(rows)}, sys.stdout)
        sys.stdout.write("\n")
        return 0
    from qkv.trace.render.keys_terminal import render_keys

    render_keys(console, anatomy, rows)
    return 0


def run_key_ranks(args: argparse.Namespace) -> int:
    """--keys --tensor-parallel N: each rank's KV heads (and what goes with them), from the
    model's description alone (qkv.models.tensor_parallel.assignment)."""
    from qkv.models.loader import open_model
    from qkv.models.tensor_parallel.assignment import shares
    from qkv.models.tensor_parallel.opened import whole_spec

    opened = open_model(args.model, max_memory=args.max_memory)  # headers only: no weight is read
    spec, _ = whole_spec(opened)
    ranks = shares(spec, args.tensor_parallel, args.model)
    layers = len(spec.layers)
    if args.json:
        json.dump({"model": args.model, "tensor_parallel": args.tensor_parallel, "layers": layers, "ranks": [
            {"rank": s.rank, "kv_heads": list(s.kv_heads), "query_heads": list(s.query_heads),
             "kv_rows": [s.kv_rows.start, s.kv_rows.stop], "query_rows": [s.query_rows.start, s.query_rows.stop],
             "features": [s.features.start, s.features.stop], "vocabulary": [s.vocabulary.start, s.vocabulary.stop]}
            for s in ranks]}, sys.stdout)
        sys.stdout.write("\n")
        return 0
    from rich.table import Table

    table = Table(title=f"{args.model} over --tensor-parallel {args.tensor_parallel}: the same heads in each of "
                  f"its {layers} layers; a rank's KV cache holds its own KV heads' keys")
    for column in ("rank", "KV heads", "query heads", "MLP features", "vocabulary rows"):
        table.add_column(column, justify="right", no_wrap=True)

    def span(r: range) -> str:
        return f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start)

    for s in ranks:
        table.add_row(str(s.rank), span(s.kv_heads), span(s.query_heads), span(s.features), span(s.vocabulary))
    Console(highlight=False).print(table, soft_wrap=True)
    return 0


def _write_figures(args: argparse.Namespace, anatomy, rows: list[dict[str, object]], console: Console) -> None:
    """--png DIR and --html FILE: the anatomy's figures (each file written atomically)."""
    from qkv.trace.render.html import write_page
    from qkv.trace.render.keys_figures import keys_figures, keys_page
    from qkv.trace.render.png import render_pngs, write_pngs

    images = render_pngs(keys_figures(anatomy))
    report = Console(highlight=False, file=sys.stderr) if args.json else console  # --json: stdout is the JSON alone
    if args.png is not None:
        written = write_pngs(images, args.png)
        report.print(f"wrote {len(written)} figures into {args.png}: " + ", ".join(p.name for p in written),
                     soft_wrap=True)
    if args.html is not None:
        report.print(f"wrote {write_page(keys_page(anatomy, rows, images), args.html)}", soft_wrap=True)
