"""Stored responses in Redis: one store that ingress replicas on any number of nodes share,
so `previous_response_id` finds a response whichever replica or node stored it.

The same bounds as `MemoryResponseStore` (count, bytes, age; least recently used go first),
kept in Redis itself so every replica enforces the same ones:

- `<prefix>r:<id>`: the stored text (`encode`), with Redis's own expiry at `ttl_s`;
- `<prefix>recency`: a sorted set of ids by a sequence (`<prefix>seq`) bumped by every put
  and get, the LRU order;
- `<prefix>expires`: a sorted set of ids by expiry (ms, the server's clock), so a put can
  drop what expired from the index and the byte total too, not just the text;
- `<prefix>sizes` (a hash of id -> bytes) and `<prefix>bytes` (their running total).

Each put and get is one Lua script, which Redis runs atomically: concurrent replicas never
see a half-trimmed index or a byte total that disagrees with it. Ages use the server's clock
(`TIME`), the one clock all replicas share. Durability is the server's: with `appendonly yes`
a restart of Redis (even a kill -9) keeps every acknowledged put.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError

from ingress.responses.store import (StoredResponse, decode, encode, storable_id,
                                     store_unavailable)

# KEYS: 1 the id's text, 2 recency, 3 expires, 4 sizes, 5 bytes, 6 seq.
# ARGV[1]: the text keys' prefix (for ids other than this one), ARGV[2]: the id.
_DROP = """
local function drop(id)
    local size = redis.call('HGET', KEYS[4], id)
    if size then
        redis.call('DECRBY', KEYS[5], size)
        redis.call('HDEL', KEYS[4], id)
    end
    redis.call('ZREM', KEYS[2], id)
    redis.call('ZREM', KEYS[3], id)
    redis.call('DEL', ARGV[1] .. id)
end
"""

# A miss also drops the id's index entries: its text expired (or was evicted by Redis's
# maxmemory policy), and the byte total must stop counting it.
_GET = _DROP + """
local text = redis.call('GET', KEYS[1])
if text then
    redis.call('ZADD', KEYS[2], 'XX', redis.call('INCR', KEYS[6]), ARGV[2])
else
    drop(ARGV[2])
end
return text
"""

# ARGV[3]: the text, [4] ttl in ms, [5] max entries, [6] max bytes.
_PUT = _DROP + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)) do drop(id) end
drop(ARGV[2])
local size = string.len(ARGV[3])
local ttl = tonumber(ARGV[4])
if size <= tonumber(ARGV[6]) then
    redis.call('SET', KEYS[1], ARGV[3], 'PX', ttl)
    redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[6]), ARGV[2])
    redis.call('ZADD', KEYS[3], now + ttl, ARGV[2])
    redis.call('HSET', KEYS[4], ARGV[2], size)
    redis.call('INCRBY', KEYS[5], size)
end
while redis.call('ZCARD', KEYS[2]) > tonumber(ARGV[5])
        or tonumber(redis.call('GET', KEYS[5]) or '0') > tonumber(ARGV[6]) do
    local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
    if not oldest then  -- an empty index counts no bytes (the keys were cleared by hand)
        redis.call('SET', KEYS[5], 0)
        break
    end
    drop(oldest)
end
"""


class RedisResponseStore:
    def __init__(self, url: str, prefix: str = "orchard:responses:", max_entries: int = 1024,
                 max_bytes: int = 64 << 20, ttl_s: float = 3600.0) -> None:
        """`url`: `redis://[[user]:password@]host:port/db` (`rediss://` for TLS). Connects
        on first use, so a replica starts while Redis is down and serves once it is up."""
        self.prefix = prefix
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_ms = max(1, round(ttl_s * 1000))
        # Short timeouts and a few quick retries: a restarted server is reconnected to on
        # the next call, and a dead one fails the request in about a second (a 503) rather
        # than holding it for the client library's default of ten retries.
        self._redis = aioredis.Redis.from_url(
            url, socket_connect_timeout=2.0, socket_timeout=5.0,
            retry=Retry(ExponentialBackoff(cap=0.25, base=0.02), retries=3))
        # Scripts run by hash; a restarted server has forgotten them, and redis-py loads
        # them again on NOSCRIPT.
        self._get_script = self._redis.register_script(_GET)
        self._put_script = self._redis.register_script(_PUT)
        self._index = [prefix + name for name in ("recency", "expires", "sizes", "bytes", "seq")]

    def _keys(self, response_id: str) -> list[str]:
        return [f"{self.prefix}r:{response_id}", *self._index]

    async def get(self, response_id: str) -> StoredResponse | None:
        if not storable_id(response_id):
            return None
        try:
            text = await self._get_script(keys=self._keys(response_id),
                                          args=[f"{self.prefix}r:", response_id])
        except RedisError as error:
            raise store_unavailable(error) from error
        return None if text is None else decode(text)

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        args: list[str | int] = [f"{self.prefix}r:", response_id, encode(stored), self.ttl_ms,
                                 self.max_entries, self.max_bytes]
        try:
            await self._put_script(keys=self._keys(response_id), args=args)
        except RedisError as error:
            raise store_unavailable(error) from error

    async def count(self) -> int:
        """Responses kept now (expired ones leave the index at the next put)."""
        return int(await self._redis.zcard(self._index[0]))

    async def bytes(self) -> int:
        return int(await self._redis.get(self._index[3]) or 0)

    async def aclose(self) -> None:
        await self._redis.aclose()
