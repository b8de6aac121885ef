"""Which prompts may share prefix-cache pages: a cache namespace per request.

Each request gets a CacheScope (shared/engine/cache_scope.py): its namespace is a keyed hash
(blake2b keyed with the gateway's secret) over its tenant (the API key's digest that
http_edge/auth.py puts in scope state `tenant`; "anonymous" when no keys are configured) and
its `cache_salt` (vLLM's request field), and its tenant is the same keyed hash over the tenant
alone (per-tenant KV quotas). Workers match and fill a request's prefix cache only under its
namespace, and its chained page hashes are seeded with it, so no tenant's `cached_tokens`,
time to first token or the registry's page sets say anything about another tenant's prompts.
A salt the operator lists as shared (--shared-cache-salts) puts the prompt in one namespace
for every tenant that sends it: for prompts meant to be shared, like a common system prompt.

The key keeps the namespaces unguessable: someone who reads Redis cannot hash candidate
prompts and look them up. Every gateway replica must use the same key
(--cache-namespace-key-file), or a conversation whose turns reach two replicas finds no
cache; without one, a gateway makes a random key at start and says so."""
from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.engine.cache_scope import CacheScope
from shared.security.secret_files import read_secret_file

log = logging.getLogger("duet.gateway.cache")

ANONYMOUS = "anonymous"  # the one tenant of a gateway without API keys
SHARED = "shared"  # the owner of a shared salt's namespace (never a tenant's name: those are key-<hex>)
MIN_KEY_CHARS = 16


@dataclass(frozen=True)
class CacheNamespaces:
    key: bytes = field(repr=False)  # 64 bytes: blake2b's largest key
    shared_salts: frozenset[str] = frozenset()

    @classmethod
    def from_secret(cls, secret: str, shared_salts: Iterable[str] = ()) -> "CacheNamespaces":
        if len(secret) < MIN_KEY_CHARS:
            raise ValueError(f"the cache namespace key must have at least {MIN_KEY_CHARS} characters")
        return cls(hashlib.blake2b(secret.encode()).digest(), frozenset(shared_salts))

    @classmethod
    def random(cls, shared_salts: Iterable[str] = ()) -> "CacheNamespaces":
        return cls(os.urandom(64), frozenset(shared_salts))

    @classmethod
    def configured(cls, key_file: str | None, shared_salts: Iterable[str] = ()) -> "CacheNamespaces":
        """From the key file, or a random key (logged: replicas will not share cache routing)."""
        if key_file:
            return cls.from_secret(read_secret_file(key_file, "cache namespace key"), shared_salts)
        log.warning("no --cache-namespace-key-file: prefix-cache namespaces are keyed with a random key of this "
                    "process; other gateway replicas (and this one after a restart) will not share cached prefixes")
        return cls.random(shared_salts)

    def scope(self, tenant: str | None, cache_salt: str | None) -> CacheScope:
        tenant = tenant or ANONYMOUS
        owner = SHARED if cache_salt is not None and cache_salt in self.shared_salts else tenant
        return CacheScope(namespace=self._hash(b"duet-namespace", owner, cache_salt),
                          tenant=self._hash(b"duet-tenant", tenant))

    def _hash(self, person: bytes, *parts: str | None) -> int:
        digest = hashlib.blake2b(key=self.key, digest_size=8, person=person)
        for part in parts:  # length-prefixed, and None apart from "": no two inputs read alike
            if part is None:
                digest.update(b"\x00")
            else:
                data = part.encode()
                digest.update(b"\x01" + len(data).to_bytes(8, "little") + data)
        return int.from_bytes(digest.digest(), "little")
