"""Hash chain over a sequence's blocks: a block's key stands for every token from position 0 to its end.

Block ``i``'s key hashes its parent's key (block ``i - 1``'s, or ``ROOT``) with its own token ids,
so equal keys mean equal prefixes (the cache checks the tokens too, so a hash collision is a miss,
never wrong output). A partial tail (fewer than ``block_size`` tokens, where a finished sequence
stopped) is keyed the same way; its shorter token tuple keeps it apart from full blocks.
``RecentChains`` lets a prompt that extends a recently ended sequence reuse that sequence's keys.
"""
from __future__ import annotations

from collections import OrderedDict

ROOT = 0x5EED_CAFE  # the parent key of a sequence's first block


def block_key(parent: int, tokens: tuple[int, ...]) -> int:
    """The key of a block holding ``tokens`` after the prefix that ``parent`` stands for.

    Nothing but the token ids changes a block's keys and values today (no LoRA adapters, no
    multimodal inputs, no cache salt): anything that does must join the tuple hashed here.
    """
    return hash((parent, tokens))


class HashChain:
    """``keys[i]``: the key of block ``i`` of one sequence, for the full blocks hashed so far."""

    __slots__ = ("block_size", "keys")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.keys: list[int] = []

    def parent(self, i: int) -> int:
        """The key block ``i`` chains from."""
        return self.keys[i - 1] if i else ROOT

    def extend(self, token_ids: list[int], upto: int) -> None:
        """Key every full block inside positions ``[0, upto)`` (tokens known there only)."""
        bs = self.block_size
        for i in range(len(self.keys), min(upto, len(token_ids)) // bs):
            self.keys.append(block_key(self.parent(i), tuple(token_ids[i * bs:(i + 1) * bs])))

    def tail(self, token_ids: list[int], pos: int) -> tuple[int, tuple[int, ...], int]:
        """(parent key, tokens, key) of the block that ends at position ``pos``: full when ``pos`` is
        block-aligned, else the partial tail ``[pos - pos % block_size, pos)``; needs ``extend(pos)``."""
        bs = self.block_size
        i, m = divmod(pos, bs)
        if m == 0:
            return self.parent(i - 1), tuple(token_ids[pos - bs:pos]), self.keys[i - 1]
        tokens = tuple(token_ids[i * bs:pos])
        return self.parent(i), tokens, block_key(self.parent(i), tokens)


class RecentChains:
    """The hash chains of recently ended sequences, by their first block's key: the next turn of a
    conversation (its prompt extends the last turn's tokens) adopts their keys instead of hashing
    every block again, so admitting it costs a few C-level list compares, not one hash per block.
    Conversations often share a first block (a system prompt): each first key keeps a few chains."""

    __slots__ = ("capacity", "per_key", "chains")

    def __init__(self, capacity: int = 16, per_key: int = 4) -> None:
        self.capacity = capacity  # first keys remembered (their token lists stay alive)
        self.per_key = per_key
        self.chains: OrderedDict[int, list[tuple[list[int], list[int]]]] = OrderedDict()  # newest last

    def remember(self, token_ids: list[int], chain: HashChain) -> None:
        """``chain`` (no longer extended) keys a prefix of ``token_ids`` (only ever appended to)."""
        if not chain.keys:
            return
        known = [c for c in self.chains.pop(chain.keys[0], []) if c[0] is not token_ids]
        self.chains[chain.keys[0]] = [(token_ids, chain.keys), *known][:self.per_key]
        if len(self.chains) > self.capacity:
            self.chains.popitem(last=False)

    def seed(self, chain: HashChain, token_ids: list[int], upto: int) -> None:
        """Key the full blocks of ``token_ids[:upto]`` in the empty ``chain``: the first by hashing,
        then as many as a remembered chain with that first block shares token for token."""
        bs = chain.block_size
        chain.extend(token_ids, min(upto, bs))
        known = self.chains.get(chain.keys[0], []) if chain.keys else []
        best: list[int] = []
        for tokens, keys in known:
            if tokens[:bs] != token_ids[:bs]:
                continue  # block 0's key matched, its tokens did not: a collision
            lo, hi = 1, min(len(keys), upto // bs)  # blocks [0, lo) are equal; find the most, up to hi
            if tokens[(hi - 1) * bs:hi * bs] == token_ids[(hi - 1) * bs:hi * bs] \
                    and tokens[:hi * bs] == token_ids[:hi * bs]:
                lo = hi  # the usual case: this prompt extends that one
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if tokens[:mid * bs] == token_ids[:mid * bs]:
                    lo = mid
                else:
                    hi = mid - 1
            if lo > len(best):
                best = keys[:lo]
            if lo == min(len(keys), upto // bs):
                break
        if len(best) > len(chain.keys):
            chain.keys = best
