"""Prometheus text for /metrics: requests, tokens, batch occupancy, time to first token,
tokens per second. Counters live here (requests, written on the event loop) and in the
engine's EngineStats (tokens, slots, written by the engine thread).

Request labels come from a fixed set of routes (`route_label`): a path no route serves is
counted as "other", so no client can make the page grow a label per path it invents; and
every label value is escaped as the Prometheus text format asks (backslash, quote, newline).
"""

from __future__ import annotations

import collections
import threading

from qkv.serve.engine.batching import EngineStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
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
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0
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
            while stats.ttft:
                seconds = stats.ttft.pop()
                self.ttft_sum += seconds
                bucket = next((i for i, edge in enumerate(TTFT_BUCKETS) if seconds <= edge), len(TTFT_BUCKETS))
                self.ttft_counts[bucket] += 1
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
                "# HELP qkv_tokens_per_second Tokens per second of the latest decode step (all slots).",
                "# TYPE qkv_tokens_per_second gauge",
                f"qkv_tokens_per_second {stats.tokens_per_second:.3f}",
                "# HELP qkv_time_to_first_token_seconds From submission to the first token.",
                "# TYPE qkv_time_to_first_token_seconds histogram",
            ]
            cumulative = 0
            for edge, n in zip((*TTFT_BUCKETS, "+Inf"), self.ttft_counts):
                cumulative += n
                lines.append(f'qkv_time_to_first_token_seconds_bucket{{le="{edge}"}} {cumulative}')
            lines += [f"qkv_time_to_first_token_seconds_sum {self.ttft_sum:.6f}",
                      f"qkv_time_to_first_token_seconds_count {cumulative}"]
        return "\n".join(lines) + "\n"
