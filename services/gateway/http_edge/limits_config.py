"""The gateway's limits against hostile or runaway load: admission (how much work runs and
how many requests wait), request body size, and timeouts for slow clients. One dataclass, filled
from CLI flags with DUET_* environment defaults (GatewayConfig nests it). The settings
only: admission.py, request_guard.py (headers, bodies) and connection_guard.py (slow
connections) enforce them."""

from __future__ import annotations

from dataclasses import dataclass, fields

from shared.settings.spec import setting


@dataclass
class GatewayLimits:
    # Admission (admission.py): work runs while it fits max_running_sequences (default: the
    # live workers' batch capacity), max_running_tokens and max_prefill_tokens (default: two
    # steps of the live prefill workers), one request at most
    # max_request_share of that at once, waiting units served fairly across API keys; at most
    # max_concurrent requests are admitted and max_queued more wait up to queue_timeout_s;
    # beyond that 429 with Retry-After. 0 = no bound (max_running_sequences: the live capacity).
    # The work budgets are each served model's (its own workers'; a set value holds for each model).
    max_concurrent: int = setting(256, flag="--max-concurrent-requests", env="DUET_MAX_CONCURRENT_REQUESTS",
                                  help="requests admitted at once; 0 = no bound")
    max_queued: int = setting(512, flag="--max-queued-requests", env="DUET_MAX_QUEUED_REQUESTS",
                              help="requests waiting beyond that; more get 429")
    queue_timeout_s: float = setting(30.0, flag="--queue-timeout", env="DUET_QUEUE_TIMEOUT",
                                     help="seconds a request waits to be admitted before 429; 0 = no deadline")
    max_running_sequences: int = setting(
        0, flag="--max-running-sequences", env="DUET_MAX_RUNNING_SEQUENCES",
        help="sequences (prompts x n) of one model generating at once; 0 = its live workers' batch capacity "
             "(the sum of their --max-running-requests), no bound when unknown")
    max_running_tokens: int = setting(
        0, flag="--max-running-tokens", env="DUET_MAX_RUNNING_TOKENS",
        help="KV tokens (prompt + n x max_tokens) one model's running sequences may fill; 0 = no bound")
    max_prefill_tokens: int = setting(
        0, flag="--max-prefill-tokens", env="DUET_MAX_PREFILL_TOKENS",
        help="prompt tokens of one model admitted and not yet prefilled by its prefill and both workers (a "
             "prompt routed to a decode worker to prefill leaves it); 0 = two steps' worth of its live "
             "prefill workers (their --max-num-batched-tokens, summed), no bound when unknown")
    gateways: int = setting(
        1, flag="--gateways", env="DUET_GATEWAYS",
        help="gateways (processes or pods) in front of the same workers: each admits its share of the live "
             "workers' capacity (the default sequence and prefill budgets over this count), so together they "
             "admit the workers' capacity once; duet up sets it to --gateway-processes, in Kubernetes keep it "
             "at the gateway Deployment's replicas")
    max_request_share: float = setting(
        0.5, flag="--max-request-share", env="DUET_MAX_REQUEST_SHARE",
        help="share of --max-running-sequences one request runs at once (its other prompts wait behind "
             "them), so another client finds room at once; 1 = the whole budget")
    admission_aging_s: float = setting(
        10.0, flag="--admission-aging", env="DUET_ADMISSION_AGING",
        help="a waiting prompt that does not fit the budget yet is passed by later ones that fit until it "
             "has waited this many seconds; then nothing passes it until it fits")
    retry_after_s: float = setting(1.0, flag="--retry-after", env="DUET_RETRY_AFTER",
                                   help="Retry-After seconds on a 429")
    # Request bodies: larger ones get 413; a body not fully sent within body_timeout_s gets 408.
    max_body_bytes: int = setting(8 << 20, flag="--max-body-bytes", env="DUET_MAX_BODY_BYTES",
                                  help="larger request bodies get 413")
    body_timeout_s: float = setting(30.0, flag="--body-timeout", env="DUET_BODY_TIMEOUT",
                                    help="seconds to receive a whole request body before 408")
    # Connections: headers must arrive within header_timeout_s of the connection opening (or
    # of the previous response), an idle keep-alive connection closes after keep_alive_s,
    # and headers larger than max_header_bytes are refused (slowloris, header floods).
    header_timeout_s: float = setting(10.0, flag="--header-timeout", env="DUET_HEADER_TIMEOUT",
                                      help="seconds to receive a request's headers before the connection is dropped")
    # Above the idle expiry of clients and load balancers in front (httpx 5 s, cloud load
    # balancers 60 s), so they close an idle connection first (connection_guard.py).
    keep_alive_s: float = setting(75.0, flag="--keep-alive-timeout", env="DUET_KEEP_ALIVE_TIMEOUT",
                                  help="seconds an idle keep-alive connection stays open (keep it above "
                                       "the idle timeout of the clients and load balancers in front)")
    max_header_bytes: int = setting(64 << 10, flag="--max-header-bytes", env="DUET_MAX_HEADER_BYTES",
                                    help="request line + headers larger than this are refused")

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"{f.name} must be >= 0, got {getattr(self, f.name)}")
        for name in ("header_timeout_s", "keep_alive_s", "max_header_bytes", "max_body_bytes", "body_timeout_s"):
            if getattr(self, name) == 0:
                raise ValueError(f"{name} must be > 0")
        if self.gateways < 1:
            raise ValueError(f"gateways must be >= 1, got {self.gateways}")
        if not 0 < self.max_request_share <= 1:
            raise ValueError(f"max_request_share must be in (0, 1], got {self.max_request_share}")
