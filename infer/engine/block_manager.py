"""Who owns which block of the paged KV cache, and the prefix cache over full blocks.

Every request holds a block table: block ``i`` stores its tokens ``[i * B, (i + 1) * B)``.
Free blocks wait in LRU order. With prefix caching, each full block is also known by a
chained hash of its tokens (and of every token before it), so a later request whose prompt
starts with the same tokens takes those blocks by reference instead of computing them. A
block nobody references stays findable until it is handed out again, least recently used
first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


class BlockManager:
    """Allocation, reference counts and the prefix cache of ``num_blocks`` blocks.

    Args:
        num_blocks: Blocks in the pool.
        block_size: Tokens per block.
        prefix_caching: Share full blocks between requests with the same prefix.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: dict[int, bytes] = {}  # block → its chained hash
        self._by_hash: dict[bytes, int] = {}  # chained hash → block
        self.tables: dict[str, list[int]] = {}
        self._hashed: dict[str, list[bytes]] = {}  # request → hashes of its full blocks
        self.hits = 0  # prompt blocks found in the prefix cache
        self.queries = 0  # prompt blocks looked up

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def match_prefix(self, request_id: str, tokens: list[int], limit: int | None = None) -> int:
        """Give a request that holds no blocks the cached blocks its ``tokens`` start with.

        At least the last token is left to compute (its logits are needed), so a prompt
        that is all cached still runs one token.

        Args:
            request_id: The request.
            tokens: Its tokens (prompt, then output if it was preempted).
            limit: Take at most this many tokens from the cache (a request that scores its
                prompt needs the logits of the positions it has not scored yet).

        Returns:
            How many tokens the request now has in the cache (a multiple of the block size).
        """
        self.tables[request_id] = []
        self._hashed[request_id] = []
        if not self.prefix_caching:
            return 0
        usable = min(len(tokens) - 1, len(tokens) if limit is None else limit) // self.block_size
        self.queries += usable
        parent = b""
        for i in range(usable):
            parent = self._hash(parent, tokens, i)
            block = self._by_hash.get(parent)
            if block is None:
                break
            self._take(block)
            self.tables[request_id].append(block)
            self._hashed[request_id].append(parent)
            self.hits += 1
        return len(self.tables[request_id]) * self.block_size

    def ensure(self, request_id: str, num_tokens: int) -> bool:
        """Grow a request's table to hold ``num_tokens``; False (and no change) if the pool
        cannot."""
        table = self.tables.setdefault(request_id, [])
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        for _ in range(need):
            block, _ = self._free.popitem(last=False)  # least recently used
            self._forget(block)
            self._refs[block] = 1
            table.append(block)
        return True

    def commit(self, request_id: str, tokens: list[int], num_cached: int) -> None:
        """Make the request's blocks that are now full findable by later prompts.

        Args:
            request_id: The request.
            tokens: Its tokens so far (prompt, then output).
            num_cached: How many of them are in the cache.
        """
        if not self.prefix_caching:
            return
        hashed, table = self._hashed[request_id], self.tables[request_id]
        for i in range(len(hashed), num_cached // self.block_size):
            digest = self._hash(hashed[-1] if hashed else b"", tokens, i)
            hashed.append(digest)
            block = table[i]
            if digest not in self._by_hash and block not in self._hash_of:
                self._by_hash[digest] = block
                self._hash_of[block] = digest

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the blocks past the first ``num_tokens`` tokens' (positions written
        by draft tokens that were not kept)."""
        table = self.tables.get(request_id, [])
        keep = self.blocks_for(num_tokens)
        for block in table[keep:]:
            self._release(block)
        del table[keep:]

    def free(self, request_id: str) -> None:
        """Drop a request's references; blocks nobody holds go back to the pool."""
        self._hashed.pop(request_id, None)
        for block in self.tables.pop(request_id, []):
            self._release(block)

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free[block] = None  # most recently used: a cached block waits longest
            if block not in self._hash_of:  # holds nothing reusable: hand it out first
                self._free.move_to_end(block, last=False)

    def _take(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._free[block]
        self._refs[block] += 1

    def _forget(self, block: int) -> None:
        digest = self._hash_of.pop(block, None)
        if digest is not None:
            del self._by_hash[digest]

    def _hash(self, parent: bytes, tokens: list[int], index: int) -> bytes:
        size = self.block_size
        chunk = array("q", tokens[index * size : (index + 1) * size]).tobytes()
        return hashlib.blake2b(parent + chunk, digest_size=16).digest()
