"""The key anatomy as a terminal table that fits 80 columns: one line per layer and KV
head (in a pipe, a file or a narrow terminal alike), short two-line headers, and a key
under the table that says what every column means. Long outlier lists are cut with a count
of the rest (all of them are in --json).

Shape legend: D head size.
"""

from __future__ import annotations

import torch
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from qkv.trace.explain.keys import OUTLIER_RATIO, KeyAnatomy, outliers_by_pair

OUTLIERS_WIDTH = 20  # characters of the outlier column; the table is 80 wide with it


def _outliers(row: dict[str, object], width: int = OUTLIERS_WIDTH) -> str:
    """`23+55(98,97) 24(95)`: channels with their stability in %, a RoPE pair's two channels
    joined by +, the strongest-held first; cut with "+N" when longer than `width`."""
    stability = dict(zip(row["key_outliers"], row["stability"]))  # type: ignore[arg-type]
    paired = {c for pair in row["key_outlier_pairs"] for c in pair}  # type: ignore[union-attr]
    entries = [(max(stability[a], stability[b]), f"{a}+{b}({stability[a]:.0%},{stability[b]:.0%})")
               for a, b in row["key_outlier_pairs"]]  # type: ignore[union-attr, misc]
    entries += [(s, f"{c}({s:.0%})") for c, s in stability.items() if c not in paired]
    texts = [text.replace("%", "") for _, text in sorted(entries, key=lambda e: -e[0])]
    shown: list[str] = []
    for i, text in enumerate(texts):
        rest = len(texts) - i - 1
        candidate = " ".join(shown + [text]) + (f" +{rest}" if rest else "")
        if len(candidate) > width and shown:
            return " ".join(shown) + f" +{len(texts) - i}"
        shown.append(text)
    return " ".join(shown) or "-"


def _channels(values: object, width: int = 8) -> str:
    text = ", ".join(map(str, values)) or "-"  # type: ignore[call-overload]
    return text if len(text) <= width else text[: width - 2].rsplit(",", 1)[0] + " …"


def _table(rows: list[dict[str, object]]) -> Table:
    # One space of padding and the one-space divider: 2 between columns, none at the edges.
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))
    for header, justify in (("layer", "right"), ("kv\nhead", "right"), ("key\nmax/med", "right"),
                            ("key outlier channels\n(stability %)", "left"), ("value\nmax/med", "right"),
                            ("value\noutliers", "left"), ("1st key\n/median", "right"),
                            ("sink\nmass", "right")):
        table.add_column(header, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for row in rows:
        ratio = f"{row['key_ratio']:.1f}"
        if row["key_ratio_pre_rope"] is not None:
            ratio += f" [{row['key_ratio_pre_rope']:.1f}]"
        table.add_row(str(row["layer"]), str(row["kv_head"]), ratio, _outliers(row),
                      f"{row['value_ratio']:.1f}", _channels(row["value_outliers"]),
                      f"{row['first_key_norm_over_median']:.2f}", f"{row['sink_mass']:.2f}")
    return table


def _means(rows: list[dict[str, object]], over: str = "heads") -> str:
    keys = sum(float(r["key_ratio"]) for r in rows) / len(rows)  # type: ignore[arg-type]
    values = sum(float(r["value_ratio"]) for r in rows) / len(rows)  # type: ignore[arg-type]
    sink = sum(float(r["sink_mass"]) for r in rows) / len(rows)  # type: ignore[arg-type]
    return (f"Mean over {over}: key max/median {keys:.1f}, value max/median {values:.1f}, "
            f"weight on the first token {sink:.2f}.")


def _heading(kind: str, rows: list[dict[str, object]]) -> str:
    layers = ", ".join(str(n) for n in sorted({int(r["layer"]) for r in rows}))  # type: ignore[call-overload]
    if kind == "global":
        return f"Global layers ({layers}): each query sees every earlier key."
    windows = ", ".join(str(w) for w in sorted({int(r["window"]) for r in rows}))  # type: ignore[call-overload]
    return (f"Local layers ({layers}): each query sees only its last {windows} keys (a sliding window; "
            "the sink mass counts the queries whose window still holds the first token).")


def render_keys(console: Console, anatomy: KeyAnatomy, rows: list[dict[str, object]]) -> None:
    rope = "keys after RoPE (before RoPE in brackets)" if anatomy.rope else (
        "this model has no RoPE (learned absolute positions are added to its input), so keys "
        "have one form")
    console.print(f"Key anatomy of {anatomy.model} on {anatomy.tokens} tokens: {rope}.")
    kinds = [(kind, [r for r in rows if r.get("attention", "global") == kind]) for kind in ("global", "local")]
    kinds = [(kind, chosen) for kind, chosen in kinds if chosen]
    if len(kinds) == 1 and kinds[0][0] == "global":
        console.print(_table(rows))
    else:  # local and global layers apart: their queries see different spans of keys
        for kind, chosen in kinds:
            console.print(Text(_heading(kind, chosen), style="bold"))
            console.print(_table(chosen))
    console.print(Text(
        f"key max/med: the largest key channel's mean |k| over the median channel's. Outlier "
        f"channels: mean |k| over {OUTLIER_RATIO:g} x the median channel; stability: the share of "
        "tokens in which the channel is among that token's largest |k| channels (as many as there "
        "are outliers), so 100 means in every token. 1st key / median: the first token's key "
        "length over the median of the others' (a sink's key is often unlike the rest). sink "
        "mass: the mean attention weight the queries after the first put on the first token, over "
        "the query heads that share this KV head.", style="dim"))
    if len(kinds) == 1:
        console.print(_means(rows))
    else:
        for kind, chosen in kinds:
            console.print(_means(chosen, f"{kind} layers' heads"))
    if anatomy.rope and anatomy.heads:
        _render_rope(console, anatomy)


def _render_rope(console: Console, anatomy: KeyAnatomy) -> None:
    d = anatomy.head_dim
    console.print(
        f"RoPE pairs: head size {d}, {anatomy.rope_layout} layout, so channel i rotates together "
        f"with channel i + {d // 2} as pair i (a+b above: both channels of one pair are outliers).")
    pairs = outliers_by_pair(anatomy)[:4]
    if pairs:
        console.print("Outlier channels by RoPE pair (in how many of the "
                      f"{len(anatomy.heads)} layer/KV heads either channel is one): "
                      + "; ".join(f"pair {p['pair']} = channels {p['channels'][0]} and {p['channels'][1]}: "
                                  f"{p['heads']}" for p in pairs))
    bands = torch.tensor([h.band_magnitude for h in anatomy.heads]).mean(0)  # (D/2,)
    order = bands.argsort(descending=True)[:4].tolist()
    waves = anatomy.wavelengths or []
    console.print("Largest RoPE bands (pair: wavelength in tokens, RMS before RoPE): "
                  + "; ".join(f"{i}: {waves[i]:.0f}, {float(bands[i]):.2f}" for i in order))
