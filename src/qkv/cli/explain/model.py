"""`qkv explain TEXT --model M`: trace a real model on the reader's text and show it.

M is "minilm" (all-MiniLM-L6-v2, packaged offline), or whatever `qkv.load_pretrained`
loads (a checkpoint folder, a GGUF file, "smollm2"). Layers and heads are counted from 0
as transformers counts them; the query by its position counted from 1 (as the book
writes x(2)) or by its text. Also renders the book's example as PNGs and HTML.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from tokenizers import Tokenizer
from torch import nn

from qkv.cli.explain.selection import check_range, resolve_query  # noqa: F401  (re-exported)
from qkv.errors import QkvError
from qkv.trace.explain.analysis import analyse
from qkv.trace.record.export import layer_summary, query_row
from qkv.trace.record.recorder import Trace, attention_modules, trace
from qkv.serve.engine.text import display_tokens  # one way to show token texts, here and in the explorer

# Recording every query of every head costs heads × T × T numbers per layer (and the page
# embeds them): beyond these many tokens only the chosen query (or layer) is recorded.
ALL_QUERIES_UP_TO = 128
ALL_LAYERS_UP_TO = 32

# What `qkv explain --model M` traces when no TEXT is given (it says so): a sentence whose
# "it" has a clear antecedent, so the heads have something to find.
DEFAULT_SENTENCE = "The cat sat on the mat because it was tired"


@dataclass
class LoadedModel:
    name: str
    model: nn.Module
    tokenizer: Tokenizer
    encoder: bool  # BERT: bidirectional, no generation


def load_model(name: str, *, max_memory: int | None = None) -> LoadedModel:
    from qkv.runtime.prepare import prepare

    exists = Path(name).expanduser().exists()
    if name.lower() == "minilm" and not exists:  # names match as the loader matches them
        from qkv.models.hf.minilm import load_minilm

        model, tokenizer = load_minilm()
        return LoadedModel("minilm", model, tokenizer, encoder=True)
    # Prepared as `qkv generate --dtype float32 --no-compile` prepares it (qkv.runtime.prepare):
    # the checkpoint's numbers, its layers as PyTorch modules, which a trace's hooks see. A
    # missing folder or file is reported by the loader, in the words `qkv generate` uses.
    prepared = prepare(name, "float32", compile=False, max_memory=max_memory)
    return LoadedModel(name, prepared.model.eval(), prepared.tokenizer, encoder=False)


def _plural(count: int, noun: str) -> str:
    return noun if count == 1 else noun + "s"


def _write_outputs(args: argparse.Namespace, recorded: Trace, layer: int, head: int, query: int,
                   analysis: dict[str, Any] | None, generation: list | None, *, title: str,
                   subtitle: str, book: bool, console: Console,
                   generation_tokens: list[str] | None = None) -> None:
    from qkv.trace.render import png

    if args.png is None and args.html is None:
        return
    focus = recorded.layer(layer)
    images = png.render_pngs(png.layer_figures(focus, recorded.tokens, head, query))
    if args.png is not None:
        written = png.write_pngs(images, args.png)
        # soft_wrap: a path is never broken across lines, however narrow the terminal
        console.print(f"wrote {len(written)} figures into {args.png}: "
                      + ", ".join(p.name for p in written), highlight=False, soft_wrap=True)
    if args.html is not None:
        from qkv.trace.render.html import build_page, write_page

        page = build_page(recorded, title=title, subtitle=subtitle, layer=layer, head=head,
                          query=query, analysis=analysis, generation=generation, book=book,
                          images=images, generation_tokens=generation_tokens)
        console.print(f"wrote {write_page(page, args.html)}", highlight=False, soft_wrap=True)


def run_book_figures(args: argparse.Namespace, query_position: int) -> None:
    """--png / --html for the book's example (its numbers come from qkv.book.walkthrough)."""
    from qkv.trace.record.book_example import book_trace

    recorded = book_trace(d_out=args.d_out, seed=args.seed, causal=args.causal)
    console = Console(stderr=True, highlight=False) if args.json else Console(highlight=False)
    _write_outputs(
        args, recorded, 0, 0, query_position - 1, None, None,
        title="Attention, one query at a time: “Your journey starts with one step”",
        subtitle=f"The book's example (chapter 3.4): 3-d embeddings, d_out = {args.d_out}, "
        f"seed {args.seed}" + (", causal mask" if args.causal else "") + ".",
        book=True, console=console,
    )


def run_model(args: argparse.Namespace) -> int:
    text = args.text if args.text is not None else DEFAULT_SENTENCE
    if args.generate is not None and args.generate < 1:
        raise QkvError(f"--generate needs at least 1 token, got {args.generate}")
    if not text.strip():
        raise QkvError("the text is empty: give some words to explain, e.g. qkv explain \"The cat sat\" --model minilm")
    console = Console(stderr=True, highlight=False) if args.json else Console(highlight=False)
    if args.text is None:
        console.print(f"No TEXT given: explaining the default sentence \"{DEFAULT_SENTENCE}\" "
                      "(give your own as the first argument).")
    loaded = load_model(args.model, max_memory=args.max_memory)
    encoding = loaded.tokenizer.encode(text)
    ids = list(encoding.ids)
    if not ids:
        raise QkvError("the text has no tokens for this model's tokenizer; give some words")
    context_length = int(getattr(loaded.model, "context_length", len(ids)))
    if len(ids) > context_length:
        raise QkvError(f"the text has {len(ids)} tokens, more than the model's {context_length}; shorten it")
    tokens = display_tokens(loaded.tokenizer, ids)
    modules = attention_modules(loaded.model)
    check_range(args.layer, len(modules), "--layer", loaded.name, _plural(len(modules), "attention layer"))
    layer = 0 if args.layer is None else args.layer
    num_heads = int(getattr(modules[layer][1], "num_heads", 1))
    check_range(args.head, num_heads, "--head", f"layer {layer}", _plural(num_heads, "head"))
    head = 0 if args.head is None else args.head
    special = list(getattr(encoding, "special_tokens_mask", [0] * len(ids)))
    ordinary = [i for i, s in enumerate(special) if not s]
    query = resolve_query(args.query, tokens, ordinary[-1] if ordinary else len(ids) - 1)
    if args.generate is not None and loaded.encoder:
        raise QkvError(f"--generate needs a decoder; {loaded.name} is an encoder (BERT)")
    if args.generate is not None and not 1 <= args.generate <= context_length - len(ids):
        raise QkvError(
            f"--generate {args.generate}: give between 1 and {context_length - len(ids)} tokens "
            f"(the model's context length is {context_length}, the text has {len(ids)} tokens)"
        )

    t = len(ids)
    layers: list[int] | None = [layer]
    if args.html is not None and args.layer is None and t <= ALL_LAYERS_UP_TO:
        layers = None  # every layer, so the page can switch between them
    queries = None if t <= ALL_QUERIES_UP_TO else [query]
    input_ids = torch.tensor([ids])
    recorded = trace(loaded.model, input_ids, layer=layers, head=None, query=queries, tokens=tokens)
    focus = recorded.layer(layer)
    analysis = analyse(focus, head, query)

    generation = None
    if args.generate is not None:
        from qkv.trace.record.generation import trace_generation

        generation = trace_generation(loaded.model, input_ids, args.generate, layer=layer, head=head)
        new_ids = [step.token_id for step in generation]
        tokens = tokens + display_tokens(loaded.tokenizer, new_ids)  # the prompt's, then the new ones

    row = query_row(focus, recorded.tokens, head, query)
    if args.json:
        result: dict[str, Any] = {
            "model": loaded.name,
            "tokens": recorded.tokens,
            **row,
            "layer_info": layer_summary(focus),
            "num_layers": len(modules),
            "analysis": analysis,
        }
        if generation is not None:
            result["generation"] = [
                {"token": tokens[step.position], "position": step.position + 1,
                 "cached_keys": step.cache_length,
                 "weights": query_row(step.layer, tokens, head, 0)["weights"]}
                for step in generation
            ]
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    else:
        from qkv.trace.render.terminal import render_generation, render_layer

        render_layer(console, focus, recorded.tokens, head=head, query=query, analysis=analysis,
                     title=loaded.name)
        if generation is not None:
            render_generation(console, generation, tokens, head)
    _write_outputs(
        args, recorded, layer, head, query, analysis, generation,
        title=f"Attention in {loaded.name}: “{text}”",
        subtitle=f"{len(modules)} attention layers; traced with forward hooks and checked against "
        "the model's own output.", book=False, console=console, generation_tokens=tokens,
    )
    return 0
