"""Jinja2 templates from strangers (chat templates), rendered with bounds on work and size.

Jinja2's `ImmutableSandboxedEnvironment` already stops a template from reaching Python's
internals or mutating its inputs; it does not stop it from running forever or filling the
memory. `BoundedSandbox` adds, per render:

- loop iterations and calls: at most `MAX_STEPS` together (each `for` loop's iterable is
  wrapped in a counter when the template is compiled), and a wall-clock limit;
- recursion: macros and recursive loops nest at most `MAX_DEPTH` calls deep;
- size: the rendered text, and every string or list made by `*`, `+`, `%`, `~` or a
  filter, at most `MAX_CHARS`; integers given to calls and filters (widths, counts) are
  bounded the same way, so nothing huge is allocated to find out;
- numbers: an integer made by `**` or `*` at most `MAX_INT_BITS` bits, judged from the
  operands before the operation runs (one big-integer power is a single C call that no
  deadline between steps can interrupt: `9 ** (9 ** 9)` would run for minutes).

Going over a bound raises `TemplateLimitError` (a jinja2 SecurityError).

These checks give a precise reason for the common bombs; they are not the last line. Chat
templates are rendered in a child process with a memory limit that is killed at the
deadline (qkv.chat.template_process), since a check between steps cannot stop one expensive
builtin (a `sort` of a million items) and a size check after a step comes after the
allocation. `chat_environment` is the environment that child renders with.
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_STEPS = 200_000
MAX_DEPTH = 50
MAX_CHARS = 1_000_000
MAX_SECONDS = 1.0  # chat templates render in well under a millisecond
MAX_INT_BITS = 4096  # ~1,233 digits; chat templates count messages and tokens, nothing near this
_LOOP = "qkv_bounded_loop"
_SIZED = "qkv_bounded_size"
_WIDTH = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d*)(?:\.(\d*))?")


MAX_INDENT = 64  # tojson(indent=...): transformers' templates use 2 or 4


class TemplateLimitError(SecurityError):
    """A template went over one of the sandbox's bounds."""


class TemplateRefusal(Exception):
    """The template called raise_exception(message): it refuses the conversation."""


class _Budget:
    def __init__(self) -> None:
        self.steps = 0
        self.depth = 0
        self.deadline = time.monotonic() + MAX_SECONDS

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise TemplateLimitError(f"the template ran more than {MAX_STEPS:,} loop iterations and calls")
        if time.monotonic() > self.deadline:  # every step: ~50 ns against a step's microseconds
            raise TemplateLimitError(f"the template ran longer than {MAX_SECONDS} s")


_BUDGET: ContextVar[_Budget | None] = ContextVar("qkv_template_budget", default=None)


def _budget() -> _Budget:
    budget = _BUDGET.get()
    if budget is None:  # rendered outside `render`: still bounded, per call chain
        budget = _Budget()
        _BUDGET.set(budget)
    return budget


def _sized(value: Any) -> Any:
    if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > MAX_CHARS:
        raise TemplateLimitError(f"the template made a value of {len(value):,} items (at most {MAX_CHARS:,})")
    return value


def _small_numbers(args: Iterable[Any]) -> None:
    for value in args:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_CHARS:
            raise TemplateLimitError(f"the template passed the number {value} (at most {MAX_CHARS:,})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(number: int) -> str:
    return f"{number:,}" if abs(number) < 10**12 else f"a {abs(number).bit_length():,}-bit number"


def _bounded_power(base: Any, exponent: Any) -> None:
    """Refuse `base ** exponent` when its integer result would pass MAX_INT_BITS: the bits
    are exponent * log2|base|, known before the power is computed. Floats overflow in one
    step (OverflowError) and a negative exponent gives a float, so only ints need this."""
    if _is_int(base) and _is_int(exponent) and exponent > 0 and abs(base) > 1:
        bits = exponent * math.log2(abs(base))
        if bits > MAX_INT_BITS:
            raise TemplateLimitError(f"the template raises {_short(base)} to the power {_short(exponent)}: an integer of "
                                     f"about {bits:,.0f} bits (at most {MAX_INT_BITS:,})")


def _bounded_product(left: Any, right: Any) -> None:
    """Refuse `left * right` of two integers whose product would pass MAX_INT_BITS."""
    if _is_int(left) and _is_int(right) and left and right:
        bits = abs(left).bit_length() + abs(right).bit_length()
        if bits > MAX_INT_BITS:
            raise TemplateLimitError(f"the template multiplies {_short(left)} by {_short(right)}: an integer of "
                                     f"about {bits:,} bits (at most {MAX_INT_BITS:,})")


def _bounded_loop(iterable: Any) -> Iterator[Any]:
    budget = _budget()
    for item in iterable:
        budget.step()
        yield item


class BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.globals[_LOOP] = _bounded_loop
        self.globals[_SIZED] = _sized

    def bound_filters(self) -> None:
        """Wrap every registered filter in the size checks (call after adding filters)."""
        self.filters = {name: _bounded_filter(f) for name, f in self.filters.items()}

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if op == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int) and len(seq) * count > MAX_CHARS:
                    raise TemplateLimitError(f"the template repeats a value {count} times (at most {MAX_CHARS:,} items)")
            _bounded_product(left, right)
        elif op == "**":
            _bounded_power(left, right)
        elif op == "%" and isinstance(left, str):
            for width, precision in _WIDTH.findall(left):
                if max(int(width or 0), int(precision or 0)) > MAX_CHARS:
                    raise TemplateLimitError("the template formats a field wider than the size limit")
        return _sized(self.binop_table[op](left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _budget()
        budget.step()
        _small_numbers(args)
        _small_numbers(kwargs.values())
        if budget.depth >= MAX_DEPTH:
            raise TemplateLimitError(f"the template nests calls more than {MAX_DEPTH} deep")
        budget.depth += 1
        try:
            return _sized(super().call(__context, __obj, *args, **kwargs))
        finally:
            budget.depth -= 1

    def bounded_template(self, source: str) -> Any:
        """Compile `source` with every for-loop counted and every `~` size-checked."""
        tree = self.parse(source)
        if any(n.name in (_LOOP, _SIZED) for n in tree.find_all(nodes.Name)):
            raise TemplateLimitError(f"the template may not use the names {_LOOP} or {_SIZED}")
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.Name(_LOOP, "load"), [loop.iter], [], None, None, lineno=loop.lineno)
        for concat in list(tree.find_all(nodes.Concat)):
            inner = nodes.Concat(concat.nodes, lineno=concat.lineno)
            _replace(tree, concat, nodes.Call(nodes.Name(_SIZED, "load"), [inner], [], None, None, lineno=concat.lineno))
        return self.from_string(tree)


def _replace(tree: nodes.Node, old: nodes.Node, new: nodes.Node) -> None:
    """Put `new` where `old` is in its parent (Jinja nodes keep children in fields)."""
    for parent in [tree, *tree.find_all(nodes.Node)]:
        for field in parent.fields:
            value = getattr(parent, field, None)
            if value is old:
                setattr(parent, field, new)
                return
            if isinstance(value, list) and any(v is old for v in value):
                setattr(parent, field, [new if v is old else v for v in value])
                return


def _bounded_filter(f: Callable[..., Any]) -> Callable[..., Any]:
    skip = 2 if getattr(f, "jinja_pass_arg", None) is not None else 1  # context/env, then the value

    @functools.wraps(f)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _budget().step()
        _small_numbers(args[skip:])
        _small_numbers(kwargs.values())
        return _sized(f(*args, **kwargs))

    return bounded


def render(template: Any, **variables: Any) -> str:
    """Render a template made by `BoundedSandbox.bounded_template` within the bounds."""
    token = _BUDGET.set(_Budget())
    try:
        out: list[str] = []
        size = 0
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > MAX_CHARS:
                raise TemplateLimitError(f"the template's output exceeds {MAX_CHARS:,} characters")
            out.append(chunk)
        return "".join(out)
    finally:
        _BUDGET.reset(token)




def _raise_exception(message: Any) -> None:
    raise TemplateRefusal(str(message)[:200])


def _tojson(value: Any, indent: Any = None) -> str:
    if indent is not None and (not isinstance(indent, int) or isinstance(indent, bool) or not 0 <= indent <= MAX_INDENT):
        raise TemplateLimitError(f"tojson's indent must be an integer from 0 to {MAX_INDENT}, got {str(indent)[:20]}")
    return json.dumps(value, ensure_ascii=False, indent=indent)


def chat_environment() -> BoundedSandbox:
    """The sandbox chat templates render in, with what transformers' templates expect:
    loop controls, `tojson`, `raise_exception`, trimmed blocks."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.bound_filters()
    env.globals["raise_exception"] = _raise_exception
    return env
