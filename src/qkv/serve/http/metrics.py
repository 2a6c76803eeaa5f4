"""Prometheus text for /metrics: requests, tokens, batch occupancy, tokens per second, and
histograms of time to first token, queue time, prefill time and inter-token time. Counters
live here (requests, written on the event loop) and in the engine's EngineStats
(qkv.serve.engine.stats: tokens, slots, the histograms; written by the engine thread).

Request labels come from a fixed set of routes (`route_label`): a path no route serves is
counted as "other", so no client can make the page grow a label per path it invents; and
every label value is escaped as the Prometheus text format asks (backslash, quote, newline).
"""

from __future__ import annotations

import collections
import threading

from qkv.serve.engine.stats import EngineStats, Histogram

ROUTES = frozenset({"/", "/explorer/trace", "/explorer/why", "/health", "/metrics", "/v1/models",
                    "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/tokenizer_info"})
MODEL_ROUTE = "/v1/models/{model}"
OTHER = "other"


def route_label(path: str) -> str:
    """The route a request path belongs to: one of ROUTES, MODEL_ROUTE or OTHER."""
    if path in ROUTES:
        return path
    return MODEL_ROUTE if path.startswith("/v1/models/") else OTHER


def escape_label(value: str) -> str:
    """A label value as the Prometheus text format writes it between double quotes."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    def __init__(self) -> None:
        self.requests: collections.Counter[tuple[str, int]] = collections.Counter()
        self._lock = threading.Lock()

    def count(self, path: str, status: int) -> None:
        with self._lock:
            self.requests[(route_label(path), int(status))] += 1

    def requests_served(self) -> int:
        """Every HTTP request answered so far, whatever its route and status."""
        with self._lock:
            return sum(self.requests.values())

    def render(self, stats: EngineStats) -> str:
        with self._lock:
            lines = ["# HELP qkv_requests_total HTTP requests answered, by path and status.",
                     "# TYPE qkv_requests_total counter"]
            for (path, status), n in sorted(self.requests.items()):
                lines.append(f'qkv_requests_total{{path="{escape_label(path)}",status="{status}"}} {n}')
            lines += [
                "# HELP qkv_prompt_tokens_total Prompt tokens prefilled.", "# TYPE qkv_prompt_tokens_total counter",
                f"qkv_prompt_tokens_total {stats.prompt_tokens}",
                "# HELP qkv_prompt_tokens_reused_total Prompt tokens whose keys/values came from an earlier "
                "request (prefix reuse), not prefilled.", "# TYPE qkv_prompt_tokens_reused_total counter",
                f"qkv_prompt_tokens_reused_total {stats.prompt_tokens_reused}",
                "# HELP qkv_completion_tokens_total Tokens generated.", "# TYPE qkv_completion_tokens_total counter",
                f"qkv_completion_tokens_total {stats.completion_tokens}",
                "# HELP qkv_batch_slots KV cache slots (--max-batch).", "# TYPE qkv_batch_slots gauge",
                f"qkv_batch_slots {stats.slots}",
                "# HELP qkv_batch_occupancy Slots holding a running request.", "# TYPE qkv_batch_occupancy gauge",
                f"qkv_batch_occupancy {stats.occupied}",
                "# HELP qkv_queue_waiting Requests waiting for a slot.", "# TYPE qkv_queue_waiting gauge",
                f"qkv_queue_waiting {stats.waiting}",
                "# HELP qkv_decode_steps_total Batched decode steps run.", "# TYPE qkv_decode_steps_total counter",
                f"qkv_decode_steps_total {stats.steps}",
                "# HELP qkv_prefill_chunks_total Prompt pieces prefilled between decode steps.",
                "# TYPE qkv_prefill_chunks_total counter", f"qkv_prefill_chunks_total {stats.prefill_chunks}",
                "# HELP qkv_tokens_per_second Tokens per second of the latest decode step (all slots).",
                "# TYPE qkv_tokens_per_second gauge",
                f"qkv_tokens_per_second {stats.tokens_per_second:.3f}",
            ]
        for name, what, histogram in (
                ("qkv_time_to_first_token_seconds", "From submission to the first token.", stats.ttft),
                ("qkv_queue_seconds", "From submission to a slot (waiting for one).", stats.queue),
                ("qkv_prefill_seconds", "From a slot to the prompt prefilled (its chunks between decode steps).",
                 stats.prefill),
                ("qkv_inter_token_seconds", "Between two tokens of one answer.", stats.inter_token)):
            lines += _histogram(name, what, histogram)
        return "\n".join(lines) + "\n"


def _histogram(name: str, what: str, histogram: Histogram) -> list[str]:
    counts, total = histogram.snapshot()
    lines = [f"# HELP {name} {what}", f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{le="{edge}"}} {n}' for edge, n in zip((*histogram.buckets, "+Inf"), counts)]
    return [*lines, f"{name}_sum {total:.6f}", f"{name}_count {counts[-1]}"]
