"""The steps of attention in the one order the terminal walkthrough and the HTML page both
number them, so that "step 5" means the same thing wherever a reader sees it.

Each renderer writes its heading as `f"{number}. {name}..."`, starting with the name here.
The last step exists only where there are heads to concatenate and project (a real
module, not the book's single-head example). A leaf module with no imports, so the book's
walkthrough can number its steps without loading the tracer.
"""

from __future__ import annotations

STEPS: tuple[tuple[str, str], ...] = (
    ("inputs", "inputs"),
    ("projections", "W_query, W_key, W_value"),
    ("keys", "keys"),
    ("query", "query"),
    ("scores", "scores"),
    ("scaled", "scaled"),
    ("weights", "weights"),
    ("values", "values"),
    ("context", "context"),
    ("output", "heads side by side, then the output projection"),
)

_NUMBERS = {step: number for number, (step, _) in enumerate(STEPS, start=1)}
_NAMES = dict(STEPS)


def step_number(step: str) -> int:
    """The step's number, counted from 1."""
    return _NUMBERS[step]


def step_heading(step: str, detail: str = "") -> str:
    """`"3. keys = inputs @ W_key"`: the number, the shared name, then what this renderer adds."""
    return f"{step_number(step)}. {_NAMES[step]}{detail}"


def context_meaning(query_token: str, *, masked: bool) -> str:
    """What the context vector is, in words that follow the mask: with a causal mask the
    query sees only itself and the tokens before it, not the whole sentence."""
    if masked:
        return (f'"{query_token}" in the light of the tokens it may see (itself and those before '
                "it; the mask hides the later ones).")
    return f'"{query_token}" in the light of the whole sentence.'
