"""n > 1: one prompt, n sequences, one prefill.

Sequence 0 is the request itself: it prefills the prompt. At its first sample the other
n - 1 sequences are made (sequence i draws with seed + i and has its own grammar matcher)
and all n first tokens are drawn from the same logits row. The new sequences then share
the prompt's KV: its full pages through the radix tree (locked once per sequence, exactly
as a prefix-cache hit), and the partly filled last page is copied, since every sequence
writes its own next tokens there. A decode worker receiving a prefilled n > 1 request
forks the same way from the transferred pages. With the prefix cache off the full pages
are copied too; a sequence that finds no free page recomputes what it lacks (as after a
retraction), so forking never fails.

Outputs of every sequence are reported under the request's id with their `index`;
`request_finished` marks the output after which no sequence of the request is left."""
from __future__ import annotations

import torch

from .request import Req, ReqStatus


def copy_pages(engine, src: list[int], dst: list[int]) -> None:
    """Copy whole KV pages on this rank (tensor-parallel followers run it too)."""
    if not src:
        return
    buf = engine.pool.buffer
    dev = buf.device
    buf.index_copy_(0, torch.tensor(dst, device=dev), buf.index_select(0, torch.tensor(src, device=dev)))


class SequenceGroups:
    def __init__(self, engine):
        self.engine = engine
        self.live: dict[str, set[str]] = {}  # request id -> engine ids of its unfinished sequences

    def is_live(self, rid: str) -> bool:
        return rid in self.live

    # -- making the sequences ------------------------------------------------------------
    def spawn(self, parent: Req) -> list[Req]:
        """Sequences 1..n-1 of parent's request (no pages yet); parent.forked is set."""
        e = self.engine
        parent.forked = True
        p = parent.params
        base = parent.seed - parent.index
        kids = []
        for i in range(1, p.n):
            kid = Req(rid=f"{parent.rid}#{i}", prompt_ids=parent.prompt_ids, params=p,
                      max_new_tokens=parent.max_new_tokens, seed=p.child_seed(base, i),
                      prefill_only=parent.prefill_only, scope=parent.scope, index=i, group=parent.rid)
            kid.token_ids = list(parent.token_ids[:parent.num_prompt])
            kid.continues, kid.extends_finished = parent.continues, parent.extends_finished  # its prompt's
            if p.grammar is not None:
                kid.grammar = e.grammars.new_state(p.grammar)
            kids.append(kid)
        if not parent.prefill_only:
            self.live[parent.rid] = {parent.rid, *(k.rid for k in kids)}
        return kids

    def place(self, parent: Req, kids: list[Req]) -> None:
        """Give the unfinished new sequences the prompt's KV and join them to the batch."""
        e = self.engine
        kids = [k for k in kids if k.status is not ReqStatus.FINISHED]
        if not kids:
            return
        L = parent.num_prompt
        ps = e.kv.page_size
        full = L // ps
        shared, node = self._share_full_pages(parent, full)
        src, dst = [], []
        for kid in kids:
            e.requests[kid.rid] = kid
            kid.page_ids = list(shared)
            kid.num_tree_pages = len(shared)
            if node is not None:
                e.kv.cache.lock(node)
                kid.prefix_node = node
            need = parent.page_ids[len(shared):e.kv.pages_for(L)]  # pages this sequence must own
            own = e.kv.allocate(len(need))
            if own is None:  # no room: recompute from the shared pages on, as after a retraction
                kid.num_computed = len(shared) * ps
                kid.num_cached_tokens = kid.num_computed
                e.scheduler.add(kid, front=True)
                continue
            kid.page_ids += own
            src += need
            dst += own
            kid.num_computed = L
            kid.num_cached_tokens = parent.num_cached_tokens
            if e.lora is not None:  # it runs with its parent's LoRA slot
                kid.lora_slot = e.lora.share(parent.rid, kid.rid)
            e.scheduler.add_running(kid)
        copy_pages(e, src, dst)
        e.call_followers("shared.engine.sequence_group:copy_pages", src, dst)

    def _share_full_pages(self, parent: Req, full: int):
        """The prompt's full pages as tree pages (parent's own become the tree's), and the
        tree node to lock; ([], None) when the prefix cache is off."""
        kv = self.engine.kv
        if not kv.cache.enabled or full == 0:
            return [], None
        tokens = parent.prompt_ids[:full * kv.page_size]
        dups, _ = kv.cache.insert(tokens, parent.page_ids[:full], parent.scope)
        pages, node = kv.cache.match_prefix(tokens, parent.scope.cache_key)
        kv.cache.lock(node)
        if parent.prefix_node is not None:
            kv.cache.unlock(parent.prefix_node)
        kv.allocator.free(dups)
        parent.page_ids[:full] = pages
        parent.num_tree_pages, parent.prefix_node = full, node
        return pages, node

    # -- finishing -----------------------------------------------------------------------
    def finished(self, req: Req) -> bool:
        """A sequence ended; True when it was its request's last (or it had no group)."""
        key = req.out_rid
        members = self.live.get(key)
        if members is None:
            return True
        members.discard(req.rid)
        if members:
            return False
        del self.live[key]
        return True

    def members(self, rid: str) -> list[str]:
        return sorted(self.live.get(rid, ()))
