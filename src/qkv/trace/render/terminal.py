"""Terminal rendering of a traced layer: aligned tables with tokens beside their numbers and
the weights as a coloured heat row. Rich prints plain text when the output is not a TTY.

Shape legend: S keys, D head size.
"""

from __future__ import annotations

import math
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from qkv.trace.explain.analysis import ALIKE
from qkv.trace.record.export import query_row, token_at
from qkv.trace.record.generation import CacheStep
from qkv.trace.record.recorder import LayerTrace

_SHOWN_DIMS = 8  # vectors longer than this are shown by their first few entries


def _num(value: float | None) -> str:
    return "-inf" if value is None else f"{value:.4f}"


def _vector(values: list[float]) -> str:
    shown = ", ".join(_num(v) for v in values[:_SHOWN_DIMS])
    more = f", … ({len(values)} dims)" if len(values) > _SHOWN_DIMS else ""
    return f"[{shown}{more}]"


def _heat_style(weight: float) -> str:
    """Dark blue (0) to bright orange (1), as a background colour."""
    w = max(0.0, min(1.0, weight))
    red, green, blue = int(30 + 225 * w), int(40 + 120 * w), int(110 - 90 * w)
    return f"black on rgb({red},{green},{blue})" if w > 0.5 else f"white on rgb({red},{green},{blue})"


def heat_row(tokens: list[str], weights: list[float], *, colour: bool = True) -> Text:
    """One cell per key, coloured by its weight, the token written inside. Without colour
    (a pipe, a file, NO_COLOR) each token carries its weight in digits instead."""
    text = Text()
    for token, weight in zip(tokens, weights):
        if colour:
            text.append(f" {token} ", style=_heat_style(weight / max(max(weights), 1e-12)))
            text.append(" ")
        else:
            text.append(f"{token} {weight:.2f}  ")
    return text


_SHADES = " ░▒▓█"


def shade_strip(weights: list[float]) -> str:
    """One character per key, darker for more weight (relative to the largest): a heat
    strip that survives a pipe or a file."""
    top = max(max(weights), 1e-12)
    return "".join(_SHADES[min(len(_SHADES) - 1, round(w / top * (len(_SHADES) - 1)))] for w in weights)


def _has_colour(console: Console) -> bool:
    return console.color_system is not None and not console.no_color


def scale_header(layer: LayerTrace) -> str:
    """The scaled-score column's header: what the scores are multiplied by, and its value.
    Most models scale by 1/sqrt(d_k); a model with its own scale (Gemma's
    query_pre_attn_scalar) is not called 1/sqrt(d_k)."""
    if math.isclose(layer.scale, layer.head_dim ** -0.5, rel_tol=1e-6):
        return f"× 1/sqrt(d_k)\n= {layer.scale:.4f}"
    return f"× scale\n= {layer.scale:.4f}"


def _bar(weight: float, width: int = 16) -> str:
    filled = round(weight * width)
    return "█" * filled + "·" * (width - filled)


def render_layer(
    console: Console,
    layer: LayerTrace,
    tokens: list[str] | None,
    *,
    head: int,
    query: int,
    analysis: dict[str, Any] | None = None,
    title: str = "",
) -> None:
    row = query_row(layer, tokens, head, query)
    console.print(Text.assemble(
        (title + "  " if title else "", "bold green"),
        (f"layer {layer.index}", "bold"),
        f" ({layer.name or layer.kind}, {layer.num_heads} head{'s' if layer.num_heads != 1 else ''}",
        f", {layer.num_kv_heads} key/value heads" if layer.num_kv_heads != layer.num_heads else "",
        ", causal" if layer.causal else ", bidirectional", ", RoPE" if layer.rope else "",
        f", local: sliding window of {layer.window} keys" if layer.window is not None else "", ")",
    ))
    console.print(Text.assemble(
        (f"head {head}", "bold"), f" (reads key/value head {row['kv_head']})  " if layer.rope or
        layer.num_kv_heads != layer.num_heads else "  ",
        ("query ", "bold"), (f"x({row['query']['position']}) = \"{row['query']['token']}\"", "bold magenta"),
    ))
    if layer.rope:
        console.print(f"query q before RoPE = {_vector(row['query_unrotated'])}")
        console.print(f"query q after RoPE  = {_vector(row['query_vector'])}")
    else:
        console.print(f"query q = {_vector(row['query_vector'])}")
    table = Table(box=box.SIMPLE, show_header=True, pad_edge=False)
    for name, justify in (("#", "right"), ("key token", "left"), ("q · k", "right"),
                          (scale_header(layer), "right"), ("weight", "right"), ("", "left")):
        table.add_column(name, justify=justify, no_wrap=name != "key token")  # type: ignore[arg-type]
    for s, token in enumerate(row["key_tokens"]):
        weight = row["weights"][s]
        visible = row["visible"][s]
        hidden = "(outside window)" if row["outside_window"][s] else "(masked)"
        table.add_row(
            str(s + 1), token, _num(row["scores"][s]) if visible else hidden,
            _num(row["scaled_scores"][s]), f"{weight:.4f}",
            Text(_bar(weight), style=_heat_style(weight).split(" on ")[1] if visible else "dim"),
        )
    console.print(table)
    if layer.window is not None:
        console.print(window_note(row), soft_wrap=True)
    console.print(Text("weights: ", style="bold"),
                  heat_row(row["key_tokens"], row["weights"], colour=_has_colour(console)))
    console.print(f"context = weights @ values = {_vector(row['context'])}")
    if analysis:
        render_analysis(console, layer, analysis, first_token=row["key_tokens"][0])


def window_note(row: dict[str, Any]) -> str:
    """What a local layer's query can see, in words: its window of keys and those before it."""
    position, window = row["query"]["position"], row["window"]
    first = max(1, position - window + 1)
    before = sum(row["outside_window"])
    text = (f"local layer: the query x({position}) sees only the last {window} positions, x({first}) "
            f"to x({position}), itself included")
    if before:
        text += f"; the {before} key{'s' if before != 1 else ''} before x({first}) lie outside its window"
    return text + "."


def render_analysis(console: Console, layer: LayerTrace, analysis: dict[str, Any], *,
                    first_token: str = "") -> None:
    if layer.num_kv_heads != layer.num_heads:
        table = Table(title="grouped-query attention: who shares each key/value head",
                      box=box.SIMPLE, title_justify="left")
        table.add_column("kv head", justify="right")
        table.add_column("query heads")
        table.add_column("alike within", justify="right")
        table.add_column("alike across", justify="right")
        for group in analysis["kv_groups"]:
            within, across = group["within_group_similarity"], group["across_group_similarity"]
            table.add_row(str(group["kv_head"]), ", ".join(map(str, group["query_heads"])),
                          "-" if within is None else f"{within:.3f}",
                          "-" if across is None else f"{across:.3f}")
        console.print(table)
        console.print(Text(ALIKE, style="dim"))
    sinks = analysis["sink_share"]
    queries = analysis["sink_queries"]
    console.print(Text(f"weight on the first token \"{first_token}\", per head, averaged over {queries} "
                       f"quer{'y' if queries == 1 else 'ies'} (the table above is one query): ",
                       style="bold"),
                  Text("  ".join(f"{h}:{v:.2f}" for h, v in sinks.items())))
    norms = analysis["key_norms"]
    console.print(Text("key length by position: ", style="bold"),
                  Text("  ".join(f"{i + 1}:{v:.2f}" for i, v in enumerate(norms[:24]))))
    rope = analysis.get("rope")
    if rope:
        console.print(Text(
            "RoPE: the same query and key vectors rotated to other positions. Equal distance, "
            f"equal score (largest spread {rope['largest_spread_at_equal_distance']:.2e}); other "
            f"distance, other score (range {rope['spread_across_distances']:.4f}):", style="bold"))
        console.print("  " + "  ".join(f"d={d}: {s:.4f}" for d, s in rope["score_by_distance"].items()))


def render_generation(console: Console, steps: list[CacheStep], tokens: list[str], head: int) -> None:
    """Each decode step: the cache growing by one key, the new query scored against all."""
    table = Table(title=f"KV cache while generating (head {head}): each new query against the cached keys",
                  box=box.SIMPLE, title_justify="left")
    table.add_column("step", justify="right")
    table.add_column("query token")
    table.add_column("cached keys", justify="right")
    table.add_column("most weight on", no_wrap=True)
    table.add_column("weights over the cache")
    for i, step in enumerate(steps):
        row = query_row(step.layer, tokens, head, 0)
        weights = row["weights"]
        top = sorted(range(len(weights)), key=lambda s: -weights[s])[:3]
        table.add_row(
            str(i + 1), token_at(tokens, step.position), f"{step.cache_length} + 1",
            ", ".join(f"{token_at(tokens, s)} {weights[s]:.2f}" for s in top),
            heat_row([str(s + 1) for s in range(len(weights))], weights) if _has_colour(console)
            else "|" + shade_strip(weights) + "|",
        )
    console.print(table)
