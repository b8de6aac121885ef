"""Which device pages are worth a copy in the host tier when the device gives them up: chosen
by expected reuse, one setting (`--host-tier-write-policy`).

- `reused` (the default): a node is written back when something says it will be read again:
  a request's match found it (`hit`: a prefix several requests share, or a turn the next one
  extended), it was inserted by a request that continued a sequence this worker held (a
  conversation still alive: `conversation`), or a descendant already has a host copy that
  would be useless without it (`prefix`); and once the traffic is chats, every page (`chat_traffic`,
  below). Everything else leaves the device without a copy
  (`not_reused`): single-turn prompts nobody repeats cost no copy bandwidth and no host room.
- `all`: every page leaving the device is worth a copy (the tier as it was first built).
- `off`: nothing is written (the tier stays allocated; for comparing with and without).

SGLang's HiCache writes a node when its hit count reaches a threshold (`write_through` at the
first insert, `write_through_selective` at the second hit; `write_back` copies every page at
eviction and waits for it); vLLM's CPU offloading and LMCache store every computed block. The
hit rule here is SGLang's selective one at one hit; what it adds is the conversation: a chat's
newest turn has never been hit when the device needs its pages, yet it is the most likely to
be read next, so a request that extends a sequence this worker held marks what it inserts.

A conversation's next turn is recognised by its prompt: it holds the whole prompt of a request
that finished here, from its first token. `FinishedPrompts` remembers recent finished prompts (the
chained hash of each one's whole pages and the tokens after them, a bounded set, newest kept),
whether their pages are still cached or already gone. Not by the end of the sequence, the answer
included: the history a client sends back seldom holds the answer's exact tokens (text tokenized
again, a reasoning section the chat template strips), so on those a match stops where the answer
began, and on the device (with random weights, every turn) such a chat looked like one-off
prompts and was never kept.
A conversation loses at most its first turn (never read again before the device needed it),
and only while its traffic is not yet known to be chats: `ContinuedShare` follows the share of
recent finished requests that continued an earlier one (a chat of T turns: (T-1)/T; one-off
prompts: 0). From FIRST_TURN_SHARE on, every page the device gives up is worth a copy
(`chat_traffic`): a first turn is as likely to come back as the rest, and by the time its next
turn arrives (a user's or a tool's think time) the device has usually moved on. Lockstep chats
(every first turn done before any second one) show nothing to learn from; staggered ones do.
Single-turn traffic keeps the share near 0 and its pages uncopied."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from shared.settings import parsers
from shared.settings.spec import setting

POLICIES = ("reused", "all", "off")

# why a page was written back
KEEP_HIT, KEEP_CONVERSATION, KEEP_PREFIX, KEEP_ALL = "hit", "conversation", "prefix", "all"
KEEP_CHAT_TRAFFIC = "chat_traffic"  # no sign on the page, but many recent requests continued an earlier one
# why a page left the device without a copy
DROP_NOT_REUSED = "not_reused"  # the policy saw no sign of reuse
DROP_OFF = "off"  # --host-tier-write-policy off
DROP_COPY_IN_FLIGHT = "copy_in_flight"  # its copy had not landed when the device needed the page
DROP_NOT_COPIED = "not_copied"  # worth a copy, but write-back (its window, its bandwidth) had not reached it
DROP_REASONS = (DROP_NOT_REUSED, DROP_OFF, DROP_COPY_IN_FLIGHT, DROP_NOT_COPIED)
KEEP_REASONS = (KEEP_HIT, KEEP_CONVERSATION, KEEP_PREFIX, KEEP_CHAT_TRAFFIC, KEEP_ALL)

# first turns are kept once this share of the recent finished requests continued an earlier one
# (chats of two turns or more give a half and up; a mix where a fifth of the requests are chat
# turns stays under it and keeps only what its conversations prove), and until it falls under
# FIRST_TURN_SHARE_OFF (a band, so traffic near the line does not flip the rule each request);
# counted over about SHARE_WINDOW requests (distinct prompts of a page or more), and not before
# SHARE_MIN_REQUESTS have finished
FIRST_TURN_SHARE = 0.25
FIRST_TURN_SHARE_OFF = 0.2
SHARE_WINDOW = 256
SHARE_MIN_REQUESTS = 32


def keep_reason(policy: str, node, first_turns: bool = False) -> str | None:
    """Why `node` (radix_cache.RadixNode) is worth a host copy under `policy`, or None;
    first_turns: the traffic is chats (ContinuedShare.keeps_first_turns)."""
    if policy == "all":
        return KEEP_ALL
    if policy == "off":
        return None
    if node.hits:
        return KEEP_HIT
    if node.conversation:
        return KEEP_CONVERSATION
    if any(child.host_pages for child in node.children.values()):
        return KEEP_PREFIX
    return KEEP_CHAT_TRAFFIC if first_turns else None


def drop_reason(policy: str, wanted: str | None, copy_in_flight: bool) -> str:
    """Why a node leaves the device without a copy: `wanted` is its keep_reason."""
    if wanted is None:
        return DROP_OFF if policy == "off" else DROP_NOT_REUSED
    return DROP_COPY_IN_FLIGHT if copy_in_flight else DROP_NOT_COPIED


def rolling_page_hashes(tokens: Sequence[int], page_size: int, namespace: int) -> list[int]:
    """A hash per full page covering every token up to it (process-local: Python's tuple hash
    of ints is the same for the process's life; cheap next to the registry's blake2b chain)."""
    out, h = [], hash(("ns", namespace))
    for start in range(0, len(tokens) - page_size + 1, page_size):
        h = hash((h, tuple(tokens[start:start + page_size])))
        out.append(h)
    return out


@dataclass
class ContinuedShare:
    """The share of recently finished requests that continued an earlier one (a decayed count
    over about SHARE_WINDOW requests): whether the traffic is chats, whose first turns come back."""

    finished: float = 0.0
    continued: float = 0.0
    seen: int = 0
    keeps_first_turns: bool = False

    def count(self, continued: bool) -> None:
        keep = 1.0 - 1.0 / SHARE_WINDOW
        self.finished = self.finished * keep + 1.0
        self.continued = self.continued * keep + (1.0 if continued else 0.0)
        self.seen += 1
        if self.seen >= SHARE_MIN_REQUESTS:
            line = FIRST_TURN_SHARE_OFF if self.keeps_first_turns else FIRST_TURN_SHARE
            self.keeps_first_turns = self.share >= line

    @property
    def share(self) -> float:
        return self.continued / self.finished if self.finished else 0.0


class FinishedPrompts:
    """The prompts of recently finished requests, newest kept, at most `capacity`: each as the
    chained hash of its whole pages and the tokens after them, so that only a prompt holding all
    of one counts as extending it (a short prompt's whole pages may be no more than a template
    many requests share)."""

    def __init__(self, page_size: int, capacity: int = 1 << 16):
        self.page_size = page_size
        self.capacity = capacity
        self._order: OrderedDict[tuple[int, tuple[int, ...]], None] = OrderedDict()
        self._tails: dict[int, set[tuple[int, ...]]] = {}  # whole pages' hash -> the tokens after them

    def __len__(self) -> int:
        return len(self._order)

    def remember(self, prompt: Sequence[int], namespace: int) -> bool:
        """A request of this prompt finished (under `namespace`, the cache's key for its scope):
        whether the prompt is new here (not one shorter than a page, nor one remembered)."""
        hashes = rolling_page_hashes(prompt, self.page_size, namespace)
        if not hashes:
            return False
        key = (hashes[-1], tuple(prompt[len(hashes) * self.page_size:]))
        if key in self._order:
            self._order.move_to_end(key)
            return False
        self._order[key] = None
        self._tails.setdefault(key[0], set()).add(key[1])
        while len(self._order) > self.capacity:
            (head, tail), _ = self._order.popitem(last=False)
            tails = self._tails[head]
            tails.discard(tail)
            if not tails:
                del self._tails[head]
        return True

    def continued_by(self, tokens: Sequence[int], namespace: int) -> bool:
        """Whether `tokens` hold a finished prompt whole, from their first token."""
        if not self._tails:
            return False
        ps, found = self.page_size, self._tails
        for i, h in enumerate(rolling_page_hashes(tokens, ps, namespace)):
            tails = found.get(h)
            if tails:
                start = (i + 1) * ps
                if any(len(tokens) >= start + len(t) and tuple(tokens[start:start + len(t)]) == t for t in tails):
                    return True
        return False


@dataclass
class HostTierWrites:
    """The write-back settings (one policy, one bound); no heavy imports: `--help` reads this."""

    policy: str = setting(
        "reused", flag="--kv-host-write-policy", env="DUET_KV_HOST_WRITE_POLICY", choices=POLICIES,
        help="which pages leaving the device are copied to the host KV tier: reused (pages a request's match "
             "found, a continued conversation's, and first turns while a quarter or more of the requests continue "
             "earlier ones), all, or off")
    bandwidth: int = setting(
        16 << 30, flag="--kv-host-write-bandwidth", env="DUET_KV_HOST_WRITE_BANDWIDTH", parse=parsers.size,
        help="bytes a second the write-back to the host KV tier may copy, per rank, e.g. 16G; 0 = unbounded")

    def __post_init__(self) -> None:
        if self.bandwidth < 0:
            raise ValueError(f"--kv-host-write-bandwidth must be >= 0, got {self.bandwidth}")
