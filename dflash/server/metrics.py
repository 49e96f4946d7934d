"""The server's Prometheus metrics (prometheus-client), on a registry of its own (one per app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self, block_size: int):
        r = self.registry = CollectorRegistry()
        self.block_size = block_size
        self.requests = Counter("dflash_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"],
                                registry=r)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens of served requests", registry=r)
        self.prefill_tokens = Counter("dflash_prefill_tokens", "Prompt tokens actually prefilled (not reused)",
                                      registry=r)
        self.generation_tokens = Counter("dflash_generation_tokens", "Generated tokens", registry=r)
        self.cycles = Counter("dflash_cycles", "Verification cycles (one per row per engine step)", registry=r)
        self.accepted_at = Counter("dflash_draft_accepted", "Cycles whose draft token at this block position "
                                   "was accepted", ["position"], registry=r)
        lengths = tuple(float(i) for i in range(1, block_size + 1))
        self.acceptance = Histogram("dflash_acceptance_length", "Tokens committed per cycle (accepted + 1)",
                                    buckets=lengths, registry=r)
        self.tau = Histogram("dflash_request_tau", "Mean acceptance length of a finished request",
                             ["accept_rule"], buckets=lengths, registry=r)
        self.prefix_cache_bytes = Gauge("dflash_prefix_cache_bytes", "Bytes of kept prefixes (--prefix-cache-mb)",
                                        registry=r)
        self.queue_depth = Gauge("dflash_queue_depth", "Requests waiting for a batch row", registry=r)
        self.batch_size = Gauge("dflash_batch_size", "Rows in the running batch", registry=r)
        self.step_rows = Histogram("dflash_step_rows", "Rows decoded together per engine step",
                                   buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.ttft = Histogram("dflash_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("dflash_inter_token_latency_seconds", "Time between tokens of a request (a cycle's gap "
                             "over the tokens it brought)", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("dflash_request_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS, registry=r)

    def cycle(self, committed: int) -> None:
        self.cycles.inc()
        self.acceptance.observe(committed)
        for position in range(1, committed):
            self.accepted_at.labels(position=str(position)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
