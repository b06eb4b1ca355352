"""Paged KV-cache blocks: reference counts, a free queue in eviction order, and prefix
reuse by chained block hashes.

Life cycle of a block: it starts in the free queue. A sequence takes it (ref 1) to hold
tokens ``[i * B, (i + 1) * B)`` of its context. Once all B tokens are computed the block is
*full*: it gets the hash of (parent block's hash, its tokens) and enters the prefix cache,
where another sequence with the same tokens up to that point can share it (ref + 1)
instead of recomputing. A full block is never written again, so sharing needs no copy;
only a partial block is copied when a sequence forks (``n > 1``). When its last holder
lets go (ref 0) the block returns to the back of the free queue *keeping its hash*, so it
can still be revived by a prefix hit until it reaches the front and is handed out again,
which evicts it from the prefix cache (least recently freed first).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from kiln.runtime.sequence import Sequence


def block_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """Chained hash of one full block: equal only when every token before it is equal too."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(b",".join(str(t).encode() for t in tokens))
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, tokens_per_block: int, enable_block_reuse: bool = True):
        self.num_blocks, self.tokens_per_block = num_blocks, tokens_per_block
        self.enable_block_reuse = enable_block_reuse
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # prefix cache: hash -> block id
        # every block with ref 0, front = next to hand out (and evict)
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    # ---- queries ---------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running sequences."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    # ---- taking and releasing --------------------------------------------------------

    def _take_free(self) -> int:
        b, _ = self.free.popitem(last=False)
        self._forget(b)  # evict from the prefix cache
        self.ref[b] = 1
        return b

    def _forget(self, b: int) -> bool:
        """Drop block ``b``'s prefix-cache entry; True when it had one."""
        h = self.hash_of[b]
        if h is None:
            return False
        if self.cached.get(h) == b:
            del self.cached[h]
        self.hash_of[b] = None
        return True

    def _share(self, b: int) -> None:
        if self.ref[b] == 0:
            del self.free[b]
        self.ref[b] += 1

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Blocks of the prefix cache that hold ``seq``'s leading full blocks (not taken).
        At least one token is always left to compute, since its logits are needed."""
        if not self.enable_block_reuse:
            return []
        bs = self.tokens_per_block
        tokens = seq.token_ids
        matched: list[int] = []
        parent = None
        for i in range((len(tokens) - 1) // bs):
            parent = block_hash(parent, tokens[i * bs : (i + 1) * bs])
            b = self.cached.get(parent)
            if b is None:
                break
            matched.append(b)
        return matched

    def start(self, seq: Sequence, matched: list[int]) -> None:
        """Give a fresh (or preempted) sequence the matched prefix blocks."""
        assert not seq.block_ids, "sequence already holds blocks"
        for b in matched:
            self._share(b)
        seq.block_ids = list(matched)
        seq.block_hashes = [self.hash_of[b] for b in matched]  # type: ignore[misc]
        seq.num_computed = len(matched) * self.tokens_per_block
        seq.num_cached_tokens = seq.num_computed
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += seq.num_computed

    def new_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(seq.block_ids))

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make ``seq`` hold blocks for its first ``num_tokens`` tokens; False (and no
        change) when the free queue is too short."""
        need = self.new_blocks_needed(seq, num_tokens)
        if need > len(self.free):
            return False
        seq.block_ids.extend(self._take_free() for _ in range(need))
        return True

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Hash and publish every block of ``seq`` that became full and computed."""
        bs = self.tokens_per_block
        # a block holding a token the host has not read yet (overlapped stepping) waits
        full = min(seq.num_computed, seq.num_tokens - seq.num_pending) // bs
        if not self.enable_block_reuse or len(seq.block_hashes) >= full:
            return  # the common decode step: no block became full
        tokens = seq.token_ids
        for i in range(len(seq.block_hashes), full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = block_hash(parent, tokens[i * bs : (i + 1) * bs])
            b = seq.block_ids[i]
            seq.block_hashes.append(h)
            if self.hash_of[b] is None:
                self.hash_of[b] = h
                self.cached.setdefault(h, b)

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Share ``parent``'s blocks with ``child``. Full blocks are shared; a partial last
        block gets a private copy for the child: returns (src, dst) for the KV copy, or None.
        Raises when no block is free for that copy."""
        partial = parent.num_computed % self.tokens_per_block != 0 and parent.block_ids
        if partial and not self.free:
            raise RuntimeError("no free block for a forked sequence's copy")
        child.block_ids = list(parent.block_ids)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed = parent.num_computed
        for b in child.block_ids:
            self._share(b)
        if not partial:
            return None
        src = child.block_ids[-1]
        self._release(src)
        dst = self._take_free()
        child.block_ids[-1] = dst
        return src, dst

    def _release(self, b: int) -> None:
        self.ref[b] -= 1
        assert self.ref[b] >= 0, f"block {b} released more often than taken"
        if self.ref[b] == 0:
            self.free[b] = None
            if self.hash_of[b] is None:  # holds nothing reusable: hand it out first
                self.free.move_to_end(b, last=False)

    def free_sequence(self, seq: Sequence) -> None:
        """Release every block of ``seq`` (tail first, so a prompt's head, the part most
        likely to be shared, is evicted last)."""
        for b in reversed(seq.block_ids):
            self._release(b)
        seq.block_ids = []
        seq.block_hashes = []

    def reset_prefix_cache(self) -> int:
        """Forget the cached contents of every free block (blocks held by sequences keep
        theirs), so later prompts match nothing computed before: as after a fresh load,
        e.g. between benchmark cases. Returns how many blocks were forgotten."""
        return sum(self._forget(b) for b in self.free)

    # ---- invariants (tests) ----------------------------------------------------------

    def check_invariants(self, live: list[Sequence]) -> None:
        held: dict[int, int] = {}
        for s in live:
            for b in s.block_ids:
                held[b] = held.get(b, 0) + 1
        for b in range(self.num_blocks):
            assert self.ref[b] == held.get(b, 0), f"block {b}: ref {self.ref[b]} != holders"
            assert (b in self.free) == (self.ref[b] == 0), f"block {b} both free and held"
        for h, b in self.cached.items():
            assert self.hash_of[b] == h, f"prefix cache entry of block {b} is stale"
