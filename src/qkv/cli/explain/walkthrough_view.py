"""Terminal rendering of the book's walkthrough: each step with its name, shape, values and
one sentence of what it means. Coloured on a terminal, plain text when piped."""

from __future__ import annotations

import math

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text
from torch import Tensor

from qkv.book.steps import context_meaning, step_heading
from qkv.book.walkthrough import Walkthrough


def _num(value: float) -> str:
    return "-inf" if math.isinf(value) and value < 0 else f"{value:.4f}"


def _vector(t: Tensor) -> str:
    return "[" + ", ".join(_num(v) for v in t.tolist()) + "]"


def _shape(t: Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _heat(weight: float, width: int = 20) -> Text:
    """A bar whose length and colour grow with the weight."""
    filled = round(weight * width)
    shade = min(255, 80 + int(175 * weight / 0.5)) if weight > 0 else 60
    return Text("█" * filled + "·" * (width - filled), style=f"rgb({shade},{shade // 3},{255 - shade})")


def _step(console: Console, step: str, detail: str, shape: str, meaning: str) -> None:
    """A step's heading, numbered as the HTML page numbers it (qkv.book.steps)."""
    console.print()
    console.print(Text.assemble((step_heading(step, detail), "bold cyan"), ("  " + shape, "dim")))
    console.print(Text(meaning, style="italic"))


def render_walkthrough(w: Walkthrough, console: Console) -> None:
    tokens = w.tokens
    q = w.query_position - 1
    d_out = w.keys.shape[1]
    console.print(Text.assemble(("Attention, one query at a time: ", "bold"),
                                (f'"{" ".join(tokens)}"', "bold green")))
    console.print(Text.assemble(
        f"query x({w.query_position}) = ", (f'"{w.query_token}"', "bold magenta"),
        f", d_in = {w.inputs.shape[1]}, d_out = {d_out}" + (", causal" if w.causal else ""),
    ))

    _step(console, "inputs", "", _shape(w.inputs), "Each token's embedding: one row per token.")
    table = Table(box=box.SIMPLE, show_header=True)
    table.add_column("token")
    table.add_column("embedding", justify="right")
    for i, token in enumerate(tokens):
        table.add_row(token, _vector(w.inputs[i]))
    console.print(table)

    _step(console, "projections", "", _shape(w.W_key) + " each",
          "Trainable projections, drawn with torch.rand after torch.manual_seed, in that order. "
          "Row i holds what the embedding's feature i adds to a query, a key and a value.")
    table = Table(box=box.SIMPLE, show_header=True)
    table.add_column("row", justify="right")
    for name in ("W_query", "W_key", "W_value"):
        table.add_column(name, justify="right")
    for i in range(w.W_query.shape[0]):
        table.add_row(f"feature {i + 1}", _vector(w.W_query[i]), _vector(w.W_key[i]), _vector(w.W_value[i]))
    console.print(table)

    _step(console, "keys", " = inputs @ W_key", _shape(w.keys),
          "Every token's key: what it offers to be matched against a query.")
    table = Table(box=box.SIMPLE, show_header=True)
    table.add_column("token")
    table.add_column("key", justify="right")
    for i, token in enumerate(tokens):
        table.add_row(token, _vector(w.keys[i]))
    console.print(table)
    _step(console, "query", f' = x({w.query_position}) @ W_query', _shape(w.query),
          f'What "{w.query_token}" is looking for: {_vector(w.query)}')
    _step(console, "scores", " = keys @ query", _shape(w.scores),
          "One dot product per key (in token order): how well each key matches the query.")
    console.print(f"  scores = {_vector(w.scores)}")
    _step(console, "scaled", f" = scores / sqrt({d_out})", _shape(w.scaled_scores),
          f"Dividing by sqrt(d_k) = {math.sqrt(d_out):.4f} keeps softmax from saturating as d_k grows."
          + (" Keys after the query are masked with -inf." if w.causal else ""))
    console.print(f"  scaled = {_vector(w.scaled_scores)}")
    _step(console, "weights", " = softmax(scaled)", _shape(w.weights),
          f"Non-negative and summing to {float(w.weights.sum()):.4f}: the share of attention each key gets.")
    table = Table(box=box.SIMPLE, show_header=True)
    for column, justify in (("token", "left"), ("score", "right"), ("scaled", "right"),
                            ("weight", "right"), ("", "left")):
        table.add_column(column, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for i, token in enumerate(tokens):
        marker = Text(token, style="bold magenta" if i == q else "")
        if w.causal and not bool(w.visible[i]):
            marker.append(" (hidden)", style="dim")
        table.add_row(
            marker, _num(float(w.scores[i])), _num(float(w.scaled_scores[i])),
            _num(float(w.weights[i])), _heat(float(w.weights[i])),
        )
    console.print(table)

    _step(console, "values", " = inputs @ W_value", _shape(w.values),
          "What each token hands over once it is attended to.")
    table = Table(box=box.SIMPLE, show_header=True)
    table.add_column("token")
    table.add_column("value", justify="right")
    table.add_column("weight", justify="right")
    for i, token in enumerate(tokens):
        table.add_row(token, _vector(w.values[i]), _num(float(w.weights[i])))
    console.print(table)

    _step(console, "context", " = weights @ values", _shape(w.context),
          "The weighted mix of values: " + context_meaning(w.query_token, masked=not bool(w.visible.all())))
    console.print(Text(f"  context vector of \"{w.query_token}\": {_vector(w.context)}", style="bold green"))
