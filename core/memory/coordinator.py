"""One coordinator hands out and frees what a sequence needs in every cache group, all or nothing, and runs the prefix cache.

With prefix caching (nano-vllm's block manager, extended to hybrid models): computed full blocks
are registered under their hash-chain key (``cache_computed``), a sequence that ends (finished,
aborted or preempted) also leaves its partial tail block and a snapshot of its recurrent state at
its end (``free``), and a new sequence resumes from the deepest cached prefix (``match_prefix``):
shared blocks below it, a copy of a partial tail block (copy-on-write) and a restore of the
snapshot, as device copies in the next plan (``take_copies``). The last token is always recomputed.
"""
from __future__ import annotations

from armillary.memory.block_pool import BlockPool
from armillary.memory.groups import CacheGroup, FullAttentionGroup, RecurrentGroup, SlidingWindowGroup
from armillary.memory.planner import MemoryPlan
from armillary.memory.prefix_cache import PrefixHit, PrefixIndex
from armillary.memory.prefix_hash import HashChain, RecentChains
from armillary.sequence import Sequence


class CacheCoordinator:
    """The scheduler's single view of cache memory.

    ``paged`` groups draw blocks from the shared ``pool``; the ``recurrent`` group (at most one)
    hands out state slots. ``allocate`` either gives ``seq`` everything it needs in every group or
    changes nothing, so a failed admission or growth never holds memory. ``prefix`` is the prefix
    cache's index (None when prefix caching is off).
    """

    def __init__(self, pool: BlockPool, paged: list[CacheGroup], recurrent: RecurrentGroup | None,
                 block_size: int, prefix_caching: bool = False, checkpoint_interval: int = 256,
                 null_block: int = 0) -> None:
        self.pool = pool
        self.paged = paged
        self.recurrent = recurrent
        self.block_size = block_size
        self.groups: list[CacheGroup] = [*paged, *([recurrent] if recurrent is not None else [])]
        self.null_block = null_block
        self.checkpoint_interval = checkpoint_interval
        self.prefix = PrefixIndex(pool, len(paged), block_size) if prefix_caching else None
        if self.prefix is not None and recurrent is not None:
            recurrent.evict_snapshot = self.prefix.evict_snapshot
        self._chains: dict[int, HashChain] = {}  # seq_id -> its hash chain
        self._recent = RecentChains()  # ended sequences' chains: the next turn adopts their keys
        self._registered: dict[int, int] = {}  # seq_id -> full blocks of it registered so far
        # device copies the next plan carries, and what they keep from reuse until then
        self._restores: dict[int, tuple[int, int]] = {}  # seq_id -> (snapshot row or held slot, its slot)
        self._tail_copies: dict[int, list[tuple[int, int]]] = {}  # seq_id -> (cached tail block, its copy)
        self._restore_rows: dict[int, int] = {}  # seq_id -> the snapshot row it restores (pinned)
        self._end_snapshots: dict[int, tuple[int, int]] = {}  # snapshot row -> (state source, held slot)
        self.num_prompt_tokens = 0  # hit rate: cached prompt tokens / prompt tokens, first admissions
        self.num_cached_prompt_tokens = 0

    @classmethod
    def from_plan(cls, plan: MemoryPlan, prefix_caching: bool = False,
                  checkpoint_interval: int = 256) -> CacheCoordinator:
        """Groups over one pool, as ``plan`` lays them out; block 0 and the last slot are scratch."""
        scratch = 0
        pool = BlockPool(plan.num_blocks, reserved=(scratch,))
        paged: list[CacheGroup] = []
        for gid, g in enumerate(plan.paged_groups):
            if g.window:
                paged.append(SlidingWindowGroup(gid, g.layers, pool, plan.block_size, g.window, scratch))
            else:
                paged.append(FullAttentionGroup(gid, g.layers, pool, plan.block_size))
        recurrent = None
        if plan.recurrent_layers:
            recurrent = RecurrentGroup(len(paged), plan.recurrent_layers, plan.num_slots, plan.num_slots - 1,
                                       plan.num_snapshots)
        return cls(pool, paged, recurrent, plan.block_size, prefix_caching, checkpoint_interval, scratch)

    @property
    def num_paged_groups(self) -> int:
        return len(self.paged)

    def new_tables(self) -> list[list[int]]:
        """Empty block tables, one per paged group, for a sequence that holds nothing."""
        return [[] for _ in self.paged]

    def _ensure_tables(self, seq: Sequence) -> None:
        if not seq.block_tables:
            seq.block_tables = self.new_tables()
        elif len(seq.block_tables) != len(self.paged):
            raise RuntimeError(f"{seq} has {len(seq.block_tables)} block tables, the model {len(self.paged)} groups")

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        self._ensure_tables(seq)
        return sum(g.num_needed(seq, num_tokens) for g in self.paged)

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether every group can give ``seq`` what it lacks for ``num_tokens`` positions."""
        if self.blocks_needed(seq, num_tokens) > self.pool.num_free:
            return False
        return self.recurrent is None or self.recurrent.num_needed(seq, num_tokens) <= self.recurrent.num_free

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Hold positions ``[0, num_tokens)`` of ``seq`` in every group; False (nothing taken) if not all fit."""
        if not self.can_allocate(seq, num_tokens):
            return False
        for group in self.groups:
            group.allocate(seq, num_tokens)
        return True

    def release_stale(self, seq: Sequence) -> None:
        for group in self.paged:
            group.release_stale(seq)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        self._ensure_tables(seq)
        for group in self.groups:
            group.trim(seq, num_tokens)

    def free(self, seq: Sequence) -> None:
        """Return everything ``seq`` holds; with prefix caching its blocks, tail and end state stay cached."""
        self._ensure_tables(seq)
        if self.prefix is not None:
            self._cache_end(seq)
        for group in self.groups:
            group.free(seq)
        self._chains.pop(seq.seq_id, None)
        self._registered.pop(seq.seq_id, None)

    def take_fresh_slots(self) -> list[int]:
        """State slots handed out since the last call: the next step zeroes them before it runs."""
        return self.recurrent.take_fresh() if self.recurrent is not None else []

    # ---- prefix caching

    def _chain(self, seq: Sequence) -> HashChain:
        chain = self._chains.get(seq.seq_id)
        if chain is None:
            chain = self._chains[seq.seq_id] = HashChain(self.block_size)
        return chain

    def match_prefix(self, seq: Sequence) -> int:
        """Resume ``seq`` (holding nothing) at its deepest cached prefix: it shares the blocks below
        it, the next plan copies a partial tail and restores the recurrent state; returns the
        positions resumed (``seq.num_computed_tokens``), 0 without a hit. ``unmatch`` undoes it."""
        first = seq.num_preemptions == 0  # else it re-enters after preemption: counted already
        hit = None
        if self.prefix is not None and seq.state_slot is None and not any(seq.block_tables):
            self._ensure_tables(seq)
            chain = self._chain(seq)
            if not chain.keys:
                self._recent.seed(chain, seq.token_ids, len(seq) - 1)
            hit = self.prefix.find(chain, seq.token_ids, len(seq) - 1, self.paged,
                                   self.recurrent is not None)
        cached = hit.num_tokens if hit is not None and self._take_hit(seq, hit) else 0
        if self.prefix is not None and self.recurrent is not None:
            seq.chunk_stops = self._chunk_stops(seq, cached)
        if first:
            seq.num_cached_tokens = cached
            self.num_prompt_tokens += seq.num_prompt_tokens
            self.num_cached_prompt_tokens += cached
        return cached

    def _take_hit(self, seq: Sequence, hit: PrefixHit) -> bool:
        rec = self.recurrent
        if rec is not None and rec.num_free == 0:
            return False
        touched = [b for table in hit.tables for b in table if b is not None] + hit.partial
        for b in touched:
            self.pool.touch(b)
        if self.pool.num_free < len(hit.partial):
            self.pool.release(touched)
            return False
        for table, cached in zip(seq.block_tables, hit.tables):
            table.extend(self.null_block if b is None else b for b in cached)
        if hit.partial:
            copies = self.pool.allocate(len(hit.partial))
            for table, dst in zip(seq.block_tables, copies):
                table.append(dst)
            self._tail_copies[seq.seq_id] = list(zip(hit.partial, copies))  # sources pinned until the plan
        if rec is not None:
            rec.allocate(seq, hit.num_tokens)
            end = self._end_snapshots.get(hit.snapshot)
            src = end[0] if end is not None else hit.snapshot  # not yet copied out: read where it is
            self._restores[seq.seq_id] = (src, seq.state_slot)
            self.prefix.pin_snapshot(hit.snapshot)
            self._restore_rows[seq.seq_id] = hit.snapshot
        seq.num_computed_tokens = seq.num_scheduled_tokens = hit.num_tokens
        self._registered[seq.seq_id] = hit.num_tokens // self.block_size
        return True

    def unmatch(self, seq: Sequence) -> None:
        """Undo ``match_prefix`` (the admission failed): ``seq`` holds nothing and counts nothing."""
        self._drop_pending(seq)
        for group in self.groups:
            group.free(seq)
        self._chains.pop(seq.seq_id, None)
        self._registered.pop(seq.seq_id, None)
        seq.num_computed_tokens = seq.num_scheduled_tokens = 0
        if seq.num_preemptions == 0:
            self.num_prompt_tokens -= seq.num_prompt_tokens
            self.num_cached_prompt_tokens -= seq.num_cached_tokens or 0
            seq.num_cached_tokens = None

    def _drop_pending(self, seq: Sequence) -> None:
        self._restores.pop(seq.seq_id, None)
        row = self._restore_rows.pop(seq.seq_id, None)
        if row is not None:
            self.prefix.unpin_snapshot(row)
        for src, _ in self._tail_copies.pop(seq.seq_id, []):
            self.pool.release([src])

    def _chunk_stops(self, seq: Sequence, start: int) -> list[int]:
        """Block-aligned checkpoints every ``checkpoint_interval`` tokens, at least an interval past
        ``start`` (a resume mid-way, e.g. at the last turn's end, has a snapshot there already: a
        stop just after it would cost a step and save a later hit under an interval of tokens);
        with n > 1 also the prompt's last full block, so its siblings resume there."""
        every = self.checkpoint_interval
        stops = set(range(max(every, -(-(start + every) // every) * every), len(seq), every))
        if seq.params.n > 1:
            stops.add((seq.num_prompt_tokens - 1) // self.block_size * self.block_size)
        return sorted(p for p in stops if p > start)

    def cache_computed(self, seq: Sequence) -> None:
        """Register ``seq``'s newly computed full blocks and the snapshots taken inside them."""
        if self.prefix is None:
            return
        upto = min(seq.num_computed_tokens, len(seq))
        self._register_blocks(seq, upto)
        self._register_snapshots(seq, upto)

    def _register_blocks(self, seq: Sequence, upto: int) -> None:
        chain, bs = self._chain(seq), self.block_size
        chain.extend(seq.token_ids, upto)
        start = self._registered.get(seq.seq_id, 0)
        for i in range(start, upto // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            for g, table in enumerate(seq.block_tables):
                if table[i] != self.null_block:
                    self.prefix.register_block(g, chain.parent(i), tokens, chain.keys[i], table[i])
        self._registered[seq.seq_id] = max(start, upto // bs)

    def _register_snapshots(self, seq: Sequence, upto: int) -> None:
        chain = self._chain(seq)
        for pos in sorted(p for p in seq.snapshots if p <= upto):
            row = seq.snapshots.pop(pos)
            if not self.prefix.register_snapshot(*chain.tail(seq.token_ids, pos), row, evictable=True):
                self.recurrent.free_snapshot(row)

    def _cache_end(self, seq: Sequence) -> None:
        """``seq`` ends: register everything it computed, its partial tail block and its end state.

        Its end is ``num_scheduled_tokens``: a decode step still in flight (async scheduling) writes
        that last position before any later plan reads it, and its input token is known.
        """
        end = min(seq.num_scheduled_tokens, len(seq))
        if seq.seq_id in self._restores or seq.seq_id in self._tail_copies:  # its resume never ran
            self._drop_pending(seq)
            return
        self._register_blocks(seq, end)
        self._register_snapshots(seq, end)
        chain, bs = self._chain(seq), self.block_size
        self._recent.remember(seq.token_ids, chain)
        if end == 0:
            return
        parent, tokens, key = chain.tail(seq.token_ids, end)
        if end % bs:
            for g, table in enumerate(seq.block_tables):
                i = end // bs
                if i < len(table) and table[i] != self.null_block:
                    self.prefix.register_block(g, parent, tokens, key, table[i])
        rec = self.recurrent
        if rec is None or seq.state_slot is None or seq.num_scheduled_tokens > len(seq):
            return  # no state, or drafts in flight: the slot's state is not at ``end``
        if self.prefix.snapshot(parent, tokens, key) is not None:
            return  # a checkpoint already holds the state there
        row = rec.new_snapshot()
        if row is None:
            return
        self.prefix.register_snapshot(parent, tokens, key, row, evictable=False)
        src = seq.pending_state_row  # a partly accepted verify step left it there
        slot = rec.detach(seq)  # held until the next plan copies its state out
        self._end_snapshots[row] = (slot if src is None else src, slot)

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(state copies, block copies) the next plan runs before its forward: ended sequences'
        states into their snapshot rows, restores into resuming slots, partial tail copies. What
        they read is released for reuse now: later plans run after this one on the device."""
        states = [(src, row) for row, (src, _) in self._end_snapshots.items()] + list(self._restores.values())
        blocks = [pair for pairs in self._tail_copies.values() for pair in pairs]
        rec = self.recurrent
        for row, (_, slot) in self._end_snapshots.items():
            self.prefix.unpin_snapshot(row)
            rec.free_slot(slot)
        for row in self._restore_rows.values():
            self.prefix.unpin_snapshot(row)
        if blocks:
            self.pool.release([src for src, _ in blocks])
        self._end_snapshots, self._restores, self._tail_copies, self._restore_rows = {}, {}, {}, {}
        return states, blocks

    def reset_prefix_cache(self) -> None:
        """Forget every cached block and snapshot (vLLM's ``reset_prefix_cache``); call between steps."""
        if self.prefix is None:
            return
        rec = self.recurrent
        for row, (_, slot) in self._end_snapshots.items():
            rec.free_slot(slot)
        self._end_snapshots = {}
        for row in self.prefix.snapshot_keys:
            rec.free_snapshot(row)
        self.pool.free_ids.extend(self.pool.lru)
        self.pool.lru.clear()
        self.pool.cached_ids.clear()
        self.prefix = PrefixIndex(self.pool, len(self.paged), self.block_size)
        if rec is not None:
            rec.evict_snapshot = self.prefix.evict_snapshot
        self._registered.clear()  # running sequences register their computed blocks afresh

    def check_accounting(self, seqs: list[Sequence] = ()) -> None:
        """Raise ``RuntimeError`` unless every block, slot and snapshot row is in exactly one place:
        blocks free, cached (nobody holds them) or held (ref counts = holders among ``seqs``, the
        live sequences); slots free, held by ``seqs`` or by ended ones awaiting their copy; snapshot
        rows free, cached, or taken by ``seqs`` for a checkpoint not yet computed."""
        pool = self.pool
        free, lru = list(pool.free_ids), list(pool.lru)
        held = [0] * pool.num_blocks
        for seq in seqs:
            for table in seq.block_tables:
                for b in table:
                    if b not in pool.reserved:
                        held[b] += 1
        for pairs in self._tail_copies.values():  # pinned copy sources
            for src, _ in pairs:
                held[src] += 1
        in_use = [b for b in range(pool.num_blocks) if pool.ref_counts[b] > 0]
        problems = []
        if len(free) + len(lru) + len(in_use) != pool.num_usable or len(set(free) | set(lru) | set(in_use)) \
                != pool.num_usable:
            problems.append(f"blocks: {len(free)} free + {len(lru)} cached + {len(in_use)} in use "
                            f"!= {pool.num_usable}")
        if held != pool.ref_counts:
            problems.append("block ref counts differ from the sequences' tables")
        if self.prefix is not None and not set(lru) <= set(self.prefix.block_keys):
            problems.append("an LRU block is not in the prefix index")
        rec = self.recurrent
        if rec is not None:
            slots = rec.free_slots + [s.state_slot for s in seqs if s.state_slot is not None] + \
                [slot for _, slot in self._end_snapshots.values()]
            if sorted(slots) != sorted(set(range(rec.num_slots)) - {rec.scratch_slot}):
                problems.append(f"state slots: {sorted(slots)} of {rec.num_slots - 1}")
            cached = list(self.prefix.snapshot_keys) if self.prefix is not None else []
            rows = rec.free_snapshots + cached + [r for s in seqs for r in s.snapshots.values()]
            if sorted(rows) != list(range(rec.num_slots, rec.num_slots + rec.num_snapshots)):
                problems.append(f"snapshot rows: {len(rec.free_snapshots)} free + {len(cached)} cached + "
                                f"{len(rows) - len(cached) - len(rec.free_snapshots)} taken != {rec.num_snapshots}")
        if problems:
            raise RuntimeError("cache accounting: " + "; ".join(problems))

    def stats(self) -> dict[str, int | float]:
        rec = self.recurrent
        cached_snaps = len(self.prefix.snapshot_keys) if self.prefix is not None else 0
        return {
            "kv_blocks_total": self.pool.num_usable,
            "kv_blocks_used": self.pool.num_used,
            "kv_blocks_cached": self.pool.num_cached_free,  # hold a cached prefix, nobody uses them
            "kv_blocks_free": len(self.pool.free_ids),
            "state_slots_total": rec.num_slots - 1 if rec else 0,
            "state_slots_used": rec.num_used - len(self._end_snapshots) if rec else 0,
            "state_slots_held": len(self._end_snapshots),  # ended sequences' states not yet copied out
            "state_snapshots_total": rec.num_snapshots if rec else 0,
            "state_snapshots_used": rec.num_snapshots - rec.num_free_snapshots if rec else 0,
            "state_snapshots_cached": cached_snaps,
            "prefix_cache_prompt_tokens": self.num_prompt_tokens,
            "prefix_cache_hit_tokens": self.num_cached_prompt_tokens,
            "prefix_cache_hit_rate": self.num_cached_prompt_tokens / self.num_prompt_tokens
            if self.num_prompt_tokens else 0.0,
            "prefix_cache_evictions": self.pool.num_evictions,
        }
