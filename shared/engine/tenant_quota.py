"""Per-tenant KV quotas, so one tenant's flood can neither evict everyone's prefix cache nor
hold every page of a worker.

- Cached pages (`cache_share`): when pages must be evicted, the cached pages of tenants over
  their share of the device pool (the pages their live work holds plus the cached pages they
  inserted) go first, least recently used among them; then everyone's, least recently used.
  A tenant's long prompt thus evicts its own older pages before another tenant's conversation.
- Pages held by live work (`live_share`): a waiting request (the scheduler's queue, decode's
  Reserve queue) of a tenant whose live work holds at least its share of the pool lets other
  tenants' waiting work go first. Alone, it goes: a quota only reorders waiting work, it never
  refuses what nobody else wants the pages for.

1.0 turns either off. With one tenant (no API keys) neither changes anything. The tenant is a
request's CacheScope.tenant (cache_scope.py). No heavy imports: `--help` reads this file."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from shared.settings.spec import setting

T = TypeVar("T")


@dataclass
class TenantQuota:
    cache_share: float = setting(
        0.5, flag="--kv-cache-tenant-share", env="DUET_KV_CACHE_TENANT_SHARE",
        help="share of the device KV pool a tenant's live and cached pages may reach before its cached pages "
             "are evicted ahead of other tenants' (1.0 = off: plain LRU)")
    live_share: float = setting(
        0.75, flag="--kv-tenant-max-share", env="DUET_KV_TENANT_MAX_SHARE",
        help="share of the device KV pool a tenant's running requests and reservations may hold while other "
             "tenants wait: past it, their waiting work goes first (1.0 = off)")

    def __post_init__(self) -> None:
        for name in ("cache_share", "live_share"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}")

    @property
    def limits_cache(self) -> bool:
        return self.cache_share < 1.0

    @property
    def limits_live(self) -> bool:
        return self.live_share < 1.0

    def over_cache_share(self, live_pages: int, cached_pages: int, capacity: int) -> bool:
        return self.limits_cache and live_pages + cached_pages > self.cache_share * capacity

    def over_live_share(self, live_pages: int, capacity: int) -> bool:
        return self.limits_live and live_pages >= self.live_share * capacity


def first_within_share(items: Iterable[T], tenant_of: Callable[[T], int], over: Callable[[int], bool]) -> T | None:
    """The first waiting item whose tenant is within its share; None when every one's tenant
    is over (then the queue's own order decides: nobody within their share waits)."""
    verdicts: dict[int, bool] = {}
    for item in items:
        tenant = tenant_of(item)
        if tenant not in verdicts:
            verdicts[tenant] = over(tenant)
        if not verdicts[tenant]:
            return item
    return None
