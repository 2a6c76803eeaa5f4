"""`qkv explain --model M TEXT --why QUERY:KEY`: why a query picks a key, and what patching
that key does; `--sinks N` explains the attention sink; `--patch-sweep` finds the keys the
prediction depends on.

Positions are counted from 1 or named by their token text, as `--query` counts them; layers
and heads from 0. The split is exact (qkv.trace.explain.attribution) and checked against the
model's score before anything is shown.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from qkv.cli.numbers import integer
from qkv.errors import QkvError

TOP_TERMS = 12
WHY_FLAGS = ("--why", "--sinks", "--patch-sweep", "--patch-from", "--patch-source", "--patch-value", "--top")


def add_why_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("why this key (with --model, a decoder)")
    group.add_argument("--why", metavar="QUERY:KEY",
                       help="split the score of QUERY against KEY in --layer/--head exactly into "
                       "(query source x key source) terms (embedding, each earlier head and MLP, "
                       "biases) and RoPE pairs; each a position counted from 1 or a token's text, "
                       "e.g. 12:3 or is:Paris; KEY 'all' shows every key of the row")
    group.add_argument("--top", type=integer(1, 1000), metavar="N",
                       help=f"with --why: terms shown for the key (default: {TOP_TERMS})")
    group.add_argument("--sinks", type=integer(1, 100), metavar="N",
                       help="explain the attention sink: for the N heads with the most weight on the "
                       "first token, the sources of the first key's score")
    group.add_argument("--patch-from", metavar="TEXT",
                       help="with --why: replace KEY's key in --layer (its KV head) by TEXT's key at "
                       "the same position and show what changes; with --patch-sweep: the donor "
                       "prompt (same number of tokens) instead of the mean key")
    group.add_argument("--patch-source", metavar="SOURCE",
                       help="with --why: remove one source (as named in the split, e.g. L11.mlp, "
                       "L3.H2, L3.attn, embed) from --layer's keys at every position and show what "
                       "changes")
    group.add_argument("--patch-value", action="store_true",
                       help="patch values instead of keys (with --patch-from or --patch-sweep)")
    group.add_argument("--patch-sweep", action="store_true",
                       help="for every layer (or --layer) and position, patch that key in every KV "
                       "head and measure the next-token distribution: which keys the prediction "
                       "depends on")


def wants_why(args: argparse.Namespace) -> bool:
    return any((args.why is not None, args.sinks is not None, args.patch_sweep, args.top is not None,
                args.patch_from is not None, args.patch_source is not None, args.patch_value))


def given_flags(args: argparse.Namespace) -> list[str]:
    values = (args.why, args.sinks, args.patch_sweep or None, args.patch_from, args.patch_source,
              args.patch_value or None, args.top)
    return [flag for flag, value in zip(WHY_FLAGS, values) if value is not None]


def _check_flags(args: argparse.Namespace) -> None:
    for flag, value in (("--keys", args.keys), ("--generate", args.generate is not None),
                        ("--query", args.query is not None)):
        if value:
            extra = " (--why names the query)" if flag == "--query" else ""
            raise QkvError(f"{flag} does not combine with {given_flags(args)[0]}{extra}; drop one")
    if args.why is None and args.sinks is None and not args.patch_sweep:
        raise QkvError(f"{given_flags(args)[0]} needs --why QUERY:KEY or --patch-sweep")
    if args.top is not None and args.why is None:
        raise QkvError("--top sets how many terms --why shows; give --why QUERY:KEY or drop --top")
    if args.patch_from is not None and args.patch_source is not None:
        raise QkvError("give --patch-from or --patch-source, not both")
    if args.patch_source is not None and (args.patch_value or args.patch_sweep):
        raise QkvError("--patch-source removes a source from the keys of one layer: it takes "
                       "neither --patch-value nor --patch-sweep")
    if args.patch_value and args.patch_from is None and not args.patch_sweep:
        raise QkvError("--patch-value needs --patch-from TEXT or --patch-sweep")
    if args.patch_from is not None and not args.patch_from.strip():
        raise QkvError("--patch-from is empty: give the other prompt")


def _position(text: str, tokens: list[str], what: str) -> int:
    """Index from 0 of a position counted from 1, or of the first token with that text."""
    text = text.strip()
    if text.lstrip("-").isdigit():
        position = int(text)
        if not 1 <= position <= len(tokens):
            raise QkvError(f"--why {what} {position}: positions are counted from 1, between 1 and {len(tokens)}")
        return position - 1
    wanted = text.lower().lstrip("#")
    for i, token in enumerate(tokens):
        if token.replace("␣", "").lstrip("#").strip().lower() == wanted:
            return i
    listed = ", ".join(f'{i + 1}:"{t}"' for i, t in enumerate(tokens[:40]))
    raise QkvError(f"--why {what} {text!r} is neither a position nor one of the tokens ({listed})")


def parse_why(spec: str, tokens: list[str]) -> tuple[int, int | None]:
    """QUERY:KEY -> (query, key) from 0; KEY 'all' -> None (every key the query sees)."""
    query_text, sep, key_text = spec.rpartition(":")
    if not sep or not query_text.strip() or not key_text.strip():
        raise QkvError(f"--why {spec!r}: give QUERY:KEY, e.g. --why 12:3 or --why is:Paris")
    query = _position(query_text, tokens, "query")
    if key_text.strip().lower() == "all":
        return query, None
    key = _position(key_text, tokens, "key")
    if key > query:
        raise QkvError(f"--why {spec}: key {key + 1} comes after query {query + 1}; the causal mask hides it")
    return query, key


def _tokenize(loaded, text: str, what: str):
    import torch

    ids = list(loaded.tokenizer.encode(text).ids)
    context = int(getattr(loaded.model, "context_length", len(ids)))
    if not ids or len(ids) > context:
        raise QkvError(f"{what} has {len(ids)} tokens; give between 1 and {context}")
    return torch.tensor([ids])


def run_why(args: argparse.Namespace) -> int:
    from rich.console import Console

    from qkv.cli.explain.model import check_range, load_model
    from qkv.serve.engine.text import display_tokens
    from qkv.trace.render.attribution_legend import legend_lines, sink_sentences

    _check_flags(args)
    text = args.text if args.text is not None else ""
    if not text.strip():
        raise QkvError("the text is empty: give the words to explain, e.g. "
                       "qkv explain \"The cat sat on the mat\" --model smollm2 --why 6:2")
    loaded = load_model(args.model, max_memory=args.max_memory)
    if loaded.encoder:
        raise QkvError(f"{given_flags(args)[0]} explains decoders' keys; {loaded.name} is an encoder (BERT)")
    ids = _tokenize(loaded, text, "the text")
    tokens = display_tokens(loaded.tokenizer, ids[0].tolist())
    layers = list(loaded.model.attention_layers())
    check_range(args.layer, len(layers), "--layer", loaded.name, "attention layers")
    layer = 0 if args.layer is None else args.layer
    check_range(args.head, layers[layer].num_heads, "--head", f"layer {layer}", "heads")
    head = 0 if args.head is None else args.head
    donor_ids = None if args.patch_from is None else _tokenize(loaded, args.patch_from, "--patch-from")

    out: dict[str, Any] = {"model": loaded.name, "tokens": tokens}
    lines: list[str] = []
    result = None
    key = None
    legend: list[str] = []  # what the words and columns mean, printed once after everything
    if args.why is not None:
        result, key, why_lines, why_legend = _why(args, loaded, ids, tokens, layer, head, donor_ids, out)
        lines += why_lines
        legend += why_legend
    if args.sinks is not None:
        from qkv.trace.render.attribution_view import sink_lines
        from qkv.trace.explain.sink import explain_sinks

        if ids.shape[1] < 2:
            raise QkvError("--sinks needs a text of at least 2 tokens")
        sinks = explain_sinks(loaded.model, ids, count=args.sinks)
        out["sinks"] = [s.to_json() for s in sinks]
        lines += ([""] if lines else []) + sink_lines(sinks)
        legend += sink_sentences(sinks, sources=not legend)
    if args.patch_sweep:
        from qkv.trace.render.attribution_view import sweep_lines
        from qkv.trace.explain.patching import patch_sweep

        sweep = patch_sweep(loaded.model, ids, layers=range(len(layers)) if args.layer is None else [layer],
                            kind="value" if args.patch_value else "key", donor_ids=donor_ids)
        out["sweep"] = {"kind": sweep.kind, "donor": sweep.donor, "prediction": _decode(loaded)(sweep.top_token),
                        "probability": sweep.top_probability,
                        "layers": [{"layer": r.layer, "kl": r.kl, "probability_drop": r.target_drop} for r in sweep.rows],
                        "strongest": [{"layer": l, "position": p + 1, "token": tokens[p], "kl": kl}
                                      for l, p, kl in sweep.strongest(5)]}
        lines += ([""] if lines else []) + sweep_lines(sweep, tokens, _decode(loaded))
    if legend:
        lines += [""] + legend_lines(legend)
    console = Console(highlight=False, stderr=args.json)
    if args.json:
        json.dump(out, sys.stdout)
        sys.stdout.write("\n")
    else:
        for line in lines:
            console.print(line, markup=False, soft_wrap=True)
    if result is not None and (args.png is not None or args.html is not None):
        _write_figures(args, result, key, loaded.name, console)
    return 0


def _decode(loaded):
    return lambda token_id: loaded.tokenizer.decode([token_id], skip_special_tokens=False)


def _why(args, loaded, ids, tokens, layer, head, donor_ids, out):
    from qkv.trace.explain.attribution import attribute
    from qkv.trace.render.attribution_legend import row_sentences, why_sentences
    from qkv.trace.render.attribution_view import patch_lines, row_lines, term_lines

    query, key = parse_why(args.why, tokens)
    result = attribute(loaded.model, ids, layer=layer, head=head, query=query, tokens=tokens)
    top = TOP_TERMS if args.top is None else args.top
    out["why"] = result.to_json(top=top, only=None if key is None else [key])
    lines = row_lines(result) if key is None else term_lines(result, key, top)
    legend = row_sentences(result) if key is None else why_sentences(result, key)
    if args.patch_from is not None or args.patch_source is not None:
        if key is None:
            raise QkvError("a patch needs one key: give --why QUERY:KEY, not KEY 'all'")
        outcome, what = _patch(args, loaded, ids, tokens, layer, head, query, key, donor_ids)
        out["patch"] = {"what": what, "kl": outcome.kl, "layer_change": outcome.layer_change,
                        "weights_before": outcome.weights_before.tolist(),
                        "weights_after": outcome.weights_after.tolist(),
                        "top_before": [{"token": _decode(loaded)(i), "probability": p} for i, p in outcome.top_before],
                        "top_after": [{"token": _decode(loaded)(i), "probability": p} for i, p in outcome.top_after]}
        lines += [""] + patch_lines(outcome, what, key, _decode(loaded), tokens)
    return result, key if key is not None else query, lines, legend


def _patch(args, loaded, ids, tokens, layer, head, query, key, donor_ids):
    import torch

    from qkv.trace.explain.patching import feature_mask, patch, projections, remove_share, replace_at, source_share

    model = loaded.model
    attention = list(model.attention_layers())[layer]
    kv_head = head // (attention.num_heads // attention.num_kv_heads)
    features = feature_mask(attention, [kv_head])
    kind = "value" if args.patch_value else "key"
    if donor_ids is not None:
        if key >= donor_ids.shape[1]:
            raise QkvError(f"--patch-from has {donor_ids.shape[1]} tokens: it has no position {key + 1} to take "
                           f"the {kind} from")
        donor = projections(model, donor_ids, layer, kind)[key]  # (F,)
        edit = replace_at(torch.tensor([key]), donor[None], features)
        other = display_tokens_of(loaded, donor_ids)[key]
        what = f'{kind} {key + 1} "{tokens[key]}" in layer {layer} (kv head {kv_head}) <- "{other}" of --patch-from'
    else:
        share = source_share(model, ids, layer, args.patch_source)
        edit = remove_share(share, features)
        what = f"{args.patch_source} removed from layer {layer}'s keys (kv head {kv_head})"
    return patch(model, ids, layer=layer, edit=edit, kind=kind, observe=(layer, head, query)), what


def display_tokens_of(loaded, ids) -> list[str]:
    from qkv.serve.engine.text import display_tokens

    return display_tokens(loaded.tokenizer, ids[0].tolist())


def _write_figures(args, result, key: int, name: str, console) -> None:
    from qkv.trace.render.attribution_figures import attribution_figures
    from qkv.trace.render.png import render_pngs, write_pngs

    images = render_pngs(attribution_figures(result, key))
    if args.png is not None:
        written = write_pngs(images, args.png)
        console.print(f"wrote {len(written)} figures into {args.png}: " + ", ".join(p.name for p in written),
                      soft_wrap=True, markup=False)
    if args.html is not None:
        from qkv.trace.render.attribution_page import why_page
        from qkv.trace.render.html import write_page

        console.print(f"wrote {write_page(why_page(result, key, name, images), args.html)}",
                      soft_wrap=True, markup=False)
