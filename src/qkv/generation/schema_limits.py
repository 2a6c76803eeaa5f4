"""A JSON schema checked and bounded before the grammar compiler sees it.

    check_schema(schema)        # QkvError naming the problem: too deep, or no finite document
    schema = bounded(schema)    # numbers, strings and arrays without bounds given ones

Why before: llguidance resolves `$ref`s recursively in Rust, and a chain of a few thousand
of them overflows the thread's stack (a segfault that takes the whole server down; measured:
about 5 KB of stack per hop, 1,600 hops on 8 MB). A `$ref` loop that every document must
follow (`a -> a`, or an object that requires itself) compiles, and then admits no document:
the matcher errors on its first mask, or the reply runs until max_tokens. Both are found
here by one iterative walk (the schema may be nested deeper than Python's recursion).

Depth counts every JSON object and array along a path, following `$ref`s (`#/json/pointer`,
`#anchor`, `$id` URIs); a recursive group (a strongly connected part of that graph, as a
tree's node refers back to itself) counts as long as all its members together, which bounds
how deep any resolver's recursion can go. A `$ref` this walk cannot resolve counts as if all
of them chained. Every `$ref` anywhere is followed, even in `const` or `default` data: the
compiler may be pointed at any part of the document.

Bounds (`bounded`), added only where the schema gives none, so that every document the
bounded schema admits is valid under the original (the reply still validates), and so that
a model that keeps choosing digits cannot run to max_tokens inside one number:
- integers and numbers: at most MAX_INTEGER_DIGITS digits before the point (|x| < 10^16,
  llama.cpp's JSON grammar's cap), and numbers at most NUMBER_DECIMALS digits after it
  (`multipleOf: 1e-10`, the finest step llguidance takes exactly);
- strings (without `pattern`, `format`, `enum` or `const`): MAX_STRING_LENGTH characters;
- arrays: MAX_ARRAY_ITEMS items.
Objects are not bounded (llguidance takes maxProperties only when every property is
required); a forced tool call's objects are closed instead (qkv.serve.api.tools). A value
the schema leaves untyped (`{}`) is the compiler's own JSON, unbounded; json_object mode's
values are bounded (ANY_JSON_OBJECT).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urldefrag, urljoin

from qkv.errors import QkvError

MAX_SCHEMA_NESTING = 100  # JSON levels (llguidance's own parser stops at 128, its wrapper included)
MAX_SCHEMA_DEPTH = 512  # nested objects/arrays and $ref hops along any path: ~2.5 MB of stack at worst

MAX_INTEGER_DIGITS = 16
INTEGER_BOUND = 10**MAX_INTEGER_DIGITS - 1
NUMBER_DECIMALS = 10
NUMBER_STEP = 1e-10
MAX_STRING_LENGTH = 2048
MAX_ARRAY_ITEMS = 256

_Node = tuple  # (parent index or -1, key or index in the parent)


def _pointer(nodes: list[_Node], index: int) -> str:
    """The JSON pointer of node `index` ('#' for the root), for messages."""
    parts: list[str] = []
    while index > 0:
        parent, key = nodes[index]
        parts.append(str(key).replace("~", "~0").replace("/", "~1"))
        index = parent
    pointer = "#" + "".join("/" + part for part in reversed(parts))
    return pointer if len(pointer) <= 80 else pointer[:60] + "/.../" + pointer.rsplit("/", 1)[-1][:16]


class _Graph:
    """Every object and array of the schema as a node, with its children and its $ref targets."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.values: list[Any] = []
        self.nodes: list[_Node] = []
        self.children: list[dict[Any, int]] = []  # per node: key or index -> child node
        self.refs: dict[int, int] = {}  # node with a $ref -> the node it resolves to
        self.unresolved = 0
        resources: dict[str, int] = {}
        anchors: dict[tuple[str, str], int] = {}
        refs: list[tuple[int, str, str]] = []  # (node, $ref, base URI)
        stack: list[tuple[Any, int, Any, int, str]] = [(schema, -1, None, 1, "")]
        while stack:
            value, parent, key, depth, base = stack.pop()
            if depth > MAX_SCHEMA_NESTING:
                raise QkvError(f"the JSON schema is nested deeper than {MAX_SCHEMA_NESTING} levels (at "
                               f"{_pointer(self.nodes, parent)}); flatten it, or name parts in $defs")
            index = len(self.values)
            self.values.append(value)
            self.nodes.append((parent, key))
            self.children.append({})
            if parent >= 0:
                self.children[parent][key] = index
            if index == 0:
                resources[""] = 0
            if isinstance(value, dict):
                base = self._scope(value, index, base, resources, anchors)
                if isinstance(value.get("$ref"), str):
                    refs.append((index, value["$ref"], base))
                children = value.items()
            else:
                children = enumerate(value)
            for child_key, child in children:
                if isinstance(child, (dict, list)):
                    stack.append((child, index, child_key, depth + 1, base))
        for index, ref, base in refs:
            target = self._resolve(urljoin(base, ref) if base and not ref.startswith("#") else
                                   (base + ref if base else ref), resources, anchors)
            if target is None:
                self.unresolved += 1
            else:
                self.refs[index] = target
        self.edges = [[*children.values(), *([self.refs[i]] if i in self.refs else [])]
                      for i, children in enumerate(self.children)]

    @staticmethod
    def _scope(value: dict[str, Any], index: int, base: str, resources: dict[str, int],
               anchors: dict[tuple[str, str], int]) -> str:
        """The base URI inside `value` (its $id), registering it and its anchors."""
        if isinstance(value.get("$id"), str):
            uri, fragment = urldefrag(urljoin(base, value["$id"]) if base else value["$id"])
            if uri:
                resources.setdefault(uri, index)
                base = uri
            if fragment:  # an old-draft anchor ("$id": "#name")
                anchors.setdefault((base, fragment), index)
        if isinstance(value.get("$anchor"), str):
            anchors.setdefault((base, value["$anchor"]), index)
        return base

    def _resolve(self, ref: str, resources: dict[str, int], anchors: dict[tuple[str, str], int]) -> int | None:
        uri, fragment = ("", ref[1:]) if ref.startswith("#") else urldefrag(ref)  # the common case, quickly
        if uri not in resources:
            return None
        if fragment and not fragment.startswith("/"):
            return anchors.get((uri, fragment))
        index = resources[uri]
        for token in fragment.split("/")[1:] if fragment else ():
            token = unquote(token).replace("~1", "/").replace("~0", "~")
            value = self.values[index]
            if isinstance(value, dict) and isinstance(value.get(token), (dict, list)):
                key: Any = token
            elif isinstance(value, list) and token.isdigit() and int(token) < len(value) \
                    and isinstance(value[int(token)], (dict, list)):
                key = int(token)
            else:
                return None  # a missing part, or a leaf (true/false): nothing to recurse into
            index = self.children[index][key]
        return index

    def depth(self) -> int:
        """The longest path from the root, each recursive group counted as all its members
        together (Tarjan's strongly connected components, iteratively: a group is complete
        only after every group it reaches, so its length is known when it is)."""
        count = len(self.values)
        order, low, on_stack, group_of = [-1] * count, [0] * count, [False] * count, [-1] * count
        stack: list[int] = []
        longest: list[int] = []  # per group, in the order they complete
        order[0] = low[0] = 0
        stack.append(0)
        on_stack[0] = True
        counter = 1
        calls = [(0, 0)]
        while calls:
            node, edge = calls[-1]
            if edge < len(self.edges[node]):
                calls[-1] = (node, edge + 1)
                child = self.edges[node][edge]
                if order[child] < 0:
                    order[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack[child] = True
                    calls.append((child, 0))
                elif on_stack[child]:
                    low[node] = min(low[node], order[child])
                continue
            calls.pop()
            if calls:
                parent = calls[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] != order[node]:
                continue
            group, members = len(longest), []
            while True:
                member = stack.pop()
                on_stack[member] = False
                group_of[member] = group
                members.append(member)
                if member == node:
                    break
            reach = max((longest[group_of[c]] for m in members for c in self.edges[m] if group_of[c] != group),
                        default=0)
            longest.append(len(members) + reach)
        return longest[group_of[0]]

    def needs(self, index: int) -> tuple[list[int], list[list[int]]]:
        """What a finite document of schema node `index` needs: every node of the first list,
        and one node of each group of the second (only what a $ref loop can make impossible:
        the $ref, allOf, anyOf/oneOf, required properties, minItems; anything else asks
        nothing, so that nothing the compiler could enforce is refused here)."""
        value = self.values[index]
        if not isinstance(value, dict):
            return [], []
        child = self.children[index]
        every = [self.refs[index]] if index in self.refs else []

        def items_of(key: str) -> list[int | None]:
            node = child.get(key)
            if node is None or not isinstance(self.values[node], list):
                return []
            return [self.children[node].get(i) for i in range(len(self.values[node]))]  # None: a leaf (true/false)

        every += [c for c in items_of("allOf") if c is not None]
        groups = [[c for c in options if c is not None] for options in (items_of("anyOf"), items_of("oneOf"))
                  if options and all(c is not None for c in options)]  # a `true` option asks nothing
        properties = child.get("properties")
        required = value.get("required")
        if properties is not None and isinstance(required, list):
            named = self.children[properties]
            every += [named[name] for name in required if isinstance(name, str) and name in named
                      and isinstance(self.values[named[name]], dict)]
        min_items = value.get("minItems")
        if type(min_items) is int and min_items > 0:
            prefix = [c for c in items_of("prefixItems")[:min_items] if c is not None]
            every += prefix
            if "items" in child and isinstance(self.values[child["items"]], dict) and len(prefix) < min_items:
                every.append(child["items"])
        return every, groups

    def unsatisfiable(self) -> int | None:
        """A node on a loop that every document of the root must follow forever, or None.
        The nodes with a finite document are found as a grammar's productive symbols are:
        from the ones that need nothing, each node once all it needs is found."""
        count = len(self.values)
        waiting = [0] * count  # per node: its needs not yet met
        watchers: list[list[tuple[int, int]]] = [[] for _ in range(count)]  # (node, group or -1)
        group_met: list[list[bool]] = []
        ready = []
        for index in range(count):
            every, groups = self.needs(index)
            waiting[index] = len(every) + len(groups)
            for need in every:
                watchers[need].append((index, -1))
            group_met.append([False] * len(groups))
            for g, options in enumerate(groups):
                for need in options:
                    watchers[need].append((index, g))
            if waiting[index] == 0:
                ready.append(index)
        finite = [False] * count
        while ready:
            node = ready.pop()
            if finite[node]:
                continue
            finite[node] = True
            for watcher, group in watchers[node]:
                if group >= 0:
                    if group_met[watcher][group]:
                        continue
                    group_met[watcher][group] = True
                waiting[watcher] -= 1
                if waiting[watcher] == 0:
                    ready.append(watcher)
        if finite[0]:
            return None
        seen, node = set(), 0  # follow unmet needs from the root until one comes round again
        while node not in seen:
            seen.add(node)
            every, groups = self.needs(node)
            node = next(n for n in [*every, *(options[0] for options in groups)] if not finite[n])
        return node


def check_schema(schema: dict[str, Any]) -> None:
    """Raise QkvError if the grammar compiler could not take `schema` safely: nested deeper
    than MAX_SCHEMA_NESTING, nesting and $refs deeper than MAX_SCHEMA_DEPTH, or a $ref loop
    that leaves no finite document."""
    graph = _Graph(schema)
    depth = graph.depth() + graph.unresolved
    if depth > MAX_SCHEMA_DEPTH:
        raise QkvError(f"the JSON schema is too deep: its objects, arrays and $ref chains go {depth} levels "
                       f"down (at most {MAX_SCHEMA_DEPTH}); shorten its $ref chains")
    loop = graph.unsatisfiable()
    if loop is not None:
        raise QkvError(f"the JSON schema is recursive with no finite document: {_pointer(graph.nodes, loop)} needs "
                       "itself again (through $ref, allOf, required properties or minItems); make the "
                       "recursion optional")


# response_format json_object: an object of any JSON values, spelled as a schema so that its
# numbers, strings and arrays are bounded as a schema's are, and its keys to MAX_KEY_LENGTH
# characters (`{"type": "object"}` alone leaves all of them to the compiler's unbounded JSON;
# llguidance does not take propertyNames, so the keys are bounded by a patternProperties).
MAX_KEY_LENGTH = 128
_ANY_KEY = {"patternProperties": {f"^.{{0,{MAX_KEY_LENGTH}}}$": {"$ref": "#/$defs/value"}}, "additionalProperties": False}
ANY_JSON_OBJECT: dict[str, Any] = {
    "type": "object", **_ANY_KEY,
    "$defs": {"value": {"anyOf": [{"type": "null"}, {"type": "boolean"}, {"type": "number"}, {"type": "string"},
                                  {"type": "array", "items": {"$ref": "#/$defs/value"}}, {"type": "object", **_ANY_KEY}]}}}

# Where subschemas sit in a schema (JSON Schema 2020-12 and the drafts before it).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
                  "contains", "propertyNames", "not", "if", "then", "else")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


def _number(value: Any) -> bool:
    return type(value) in (int, float)


def _add_bounds(schema: dict[str, Any]) -> None:
    """Bounds on `schema`'s numbers, strings and arrays where it gives none (see the module)."""
    kinds = schema.get("type")
    kinds = {kinds} if isinstance(kinds, str) else set(kinds) if isinstance(kinds, list) else set()
    if "enum" in schema or "const" in schema:
        return
    if kinds & {"integer", "number"}:
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        high = schema.get("maximum", schema.get("exclusiveMaximum"))
        if high is None and (low is None or _number(low) and low < INTEGER_BOUND):
            schema["maximum"] = INTEGER_BOUND
        if low is None and (high is None or _number(high) and high > -INTEGER_BOUND):
            schema["minimum"] = -INTEGER_BOUND
        narrow = _number(low) and _number(high) and high - low < 1  # a step could leave nothing in it
        if "number" in kinds and "multipleOf" not in schema and not narrow:
            schema["multipleOf"] = NUMBER_STEP
    if "string" in kinds and not {"maxLength", "pattern", "format"} & set(schema):
        min_length = schema.get("minLength", 0)
        if not _number(min_length) or min_length <= MAX_STRING_LENGTH:
            schema["maxLength"] = MAX_STRING_LENGTH
    if "array" in kinds and "maxItems" not in schema:
        min_items = schema.get("minItems", 0)
        if not _number(min_items) or min_items <= MAX_ARRAY_ITEMS:
            schema["maxItems"] = MAX_ARRAY_ITEMS


def bounded(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` with bounds where it has none (the module says which); `schema`
    itself is not changed. Only subschemas are touched, never `const`, `enum` or `default`
    data; iterative, as the checks are."""
    root = dict(schema)
    stack = [root]
    while stack:
        node = stack.pop()
        _add_bounds(node)
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                node[key] = {name: dict(sub) if isinstance(sub, dict) else sub for name, sub in node[key].items()}
                stack += [sub for sub in node[key].values() if isinstance(sub, dict)]
        for key in _SCHEMA_VALUES:
            if isinstance(node.get(key), dict):
                node[key] = dict(node[key])
                stack.append(node[key])
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                node[key] = [dict(sub) if isinstance(sub, dict) else sub for sub in node[key]]
                stack += [sub for sub in node[key] if isinstance(sub, dict)]
    return root
