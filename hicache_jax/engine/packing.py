"""The host side of a packed batched step: its rows, its shapes, its arrays.

:func:`plan` lays a step out (its attention rows per group, the key blocks the rows of a group
share, the shape key that decides what compiles), :func:`pack` fills the step's int32 arrays for
that layout, :func:`flatten` joins them into one host buffer (one transfer a step; the jitted
step slices it back, ``layers.unpack``). :class:`TokenSlots` is the device buffer of each
request slot's last sampled token that lets a step read decode tokens the host has not seen.
:func:`cover` finds a compiled shape that can run a step padded (no compile in steady serving).
Bucketing (:func:`bucket`, :func:`fine_bucket`) keeps the shapes, and so the compiles, few.

Used by :class:`hicache_jax.engine.model.DecoderModel.forward_batch`; pure functions (numpy)
but for :class:`TokenSlots`, which belongs to its engine's thread.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from hicache_jax.engine.weights import ModelConfig

__all__ = [
    "NO_SLOTS",
    "REUSE_COST_LIMIT",
    "TokenSlots",
    "bucket",
    "check_slots",
    "cover",
    "feed_arrays",
    "fine_bucket",
    "flatten",
    "holds",
    "lens_used",
    "pack",
    "plan",
    "shared_blocks",
    "step_rows",
    "work",
]


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(int(n), minimum)
    return 1 << (n - 1).bit_length()


def fine_bucket(n: int, minimum: int = 1) -> int:
    """Smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (2^k and 3 * 2^k) >= max(n, minimum):
    at most 1.5x padding, two buckets per octave."""
    n = max(int(n), minimum)
    p = bucket(n)
    return p * 3 // 4 if p >= 4 and n <= p * 3 // 4 else p


class TokenSlots:
    """Each request slot's last sampled token, on the device: what lets a batched engine
    dispatch step N+1 before step N's tokens reach the host (SGLang's overlap scheduler).

    A packed step (:meth:`DecoderModel.forward_batch` with ``slots=``) writes every chunk's
    sampled token to the chunk's slot and reads a decode token marked ``from_slot`` from its
    slot, all on the device and in dispatch order; the host reads the step's tokens when it
    wants them. The buffer is int32 ``[n + 1]`` (slot ``n``: where padding rows write), rebound
    after each step; :meth:`take` / :meth:`give` hand the ``n`` slots to requests.

    Raises:
        ValueError: ``n`` is not an int >= 1.
    """

    def __init__(self, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n={n!r} must be an int >= 1 (slots)")
        self.n = n
        self.array = jnp.zeros(n + 1, jnp.int32)
        self._free = list(range(n - 1, -1, -1))

    def take(self) -> int:
        """A free slot (RuntimeError when all ``n`` are held: the caller admits too many)."""
        if not self._free:
            raise RuntimeError(f"all {self.n} token slots are held")
        return self._free.pop()

    def give(self, slot: int) -> None:
        """Return a slot taken by :meth:`take` (ValueError for one not held)."""
        if not 0 <= slot < self.n or slot in self._free:
            raise ValueError(f"slot {slot!r} is not held")
        self._free.append(slot)

    @property
    def free(self) -> int:
        return len(self._free)


#: ``forward_batch(reuse_compiled=True)`` pads a step into a compiled shape of at most this many
#: times its work (:func:`work`); past it a compile is the better deal for a shape that recurs.
REUSE_COST_LIMIT = 2.0


def work(cfg: ModelConfig, plan_key: tuple, ps: int) -> float:
    """Multiply-adds of a packed step of ``plan_key`` (:func:`plan`), layers aside: the dense
    layers over its flat slots, attention over its work items and shared blocks."""
    _, np_, nd, rp, qb, wp, sp, wd, sd, kb = plan_key
    d, hd = cfg.d_model, cfg.head_dim
    dense = d * (2 * cfg.num_heads * hd + 2 * cfg.num_kv_heads * hd) + 3 * d * cfg.ffn_dim
    pairs = (wp * qb + sp * rp * qb + wd + sd * nd) * kb * ps  # (query, key) pairs
    return (np_ + nd) * dense + pairs * 2 * cfg.num_heads * hd


def holds(big: tuple, small: tuple) -> bool:
    """Whether a packed step of shape ``big`` can run one of ``small`` padded: same config,
    query and key blocks, slot buffer, the same row groups, and no part of it smaller."""
    (b, *b_rest), (s, *s_rest) = big, small
    if b_rest != s_rest or b[0] != s[0] or b[4] != s[4] or b[9] != s[9]:
        return False
    if (b[1] > 0) != (s[1] > 0) or (b[2] > 0) != (s[2] > 0):
        return False
    return all(x >= y for x, y in zip(b[1:9], s[1:9]))


def cover(shape: tuple, compiled: set) -> tuple | None:
    """The cheapest shape of ``compiled`` (``(shape, "fused" | "layers")`` pairs) whose fused
    step holds ``shape`` within REUSE_COST_LIMIT x its work (None: none)."""
    (step_key, _, ps), cfg = shape, shape[0][0]
    limit = REUSE_COST_LIMIT * work(cfg, step_key, ps)
    best, best_work = None, 0.0
    for key, kind in compiled:
        if kind != "fused" or not holds(key, shape):
            continue
        w = work(cfg, key[0], ps)
        if w <= limit and (best is None or w < best_work):
            best, best_work = key, w
    return best


def check_slots(slots, slot_of, from_slot, lens: list[int]) -> tuple:
    """``(slot buffer, slot_of, from_slot)`` for :func:`feed_arrays` after checking them; without
    ``slots``, a one-entry buffer nothing reads (every row writes its padding slot)."""
    b = len(lens)
    if slots is None:
        if slot_of is not None or from_slot is not None:
            raise ValueError("slot_of / from_slot need slots=TokenSlots(...)")
        return NO_SLOTS, None, None
    if not isinstance(slots, TokenSlots):
        raise TypeError(f"slots must be a TokenSlots, got {type(slots).__name__}")
    if slot_of is None or len(slot_of) != b:
        raise ValueError(f"slots= needs slot_of with one slot per chunk ({b})")
    slot_of = [int(x) for x in slot_of]
    if any(not 0 <= x < slots.n for x in slot_of) or len(set(slot_of)) != b:
        raise ValueError(f"slot_of={slot_of} must be {b} distinct slots in [0, {slots.n})")
    from_slot = [False] * b if from_slot is None else [bool(x) for x in from_slot]
    if len(from_slot) != b:
        raise ValueError(f"from_slot has {len(from_slot)} entries for {b} chunks")
    if any(f and n != 1 for f, n in zip(from_slot, lens)):
        raise ValueError("a chunk read from its slot must be one token")
    return slots.array, slot_of, from_slot


NO_SLOTS = np.zeros(1, np.int32)  # numpy: no device array at import


def feed_arrays(n_flat: int, out_idx: np.ndarray, buf, slot_of, from_slot) -> tuple:
    """The packed step's slot arguments ``(tok_src [n_flat], out_slot [out rows])`` for the slot
    buffer ``buf`` (:func:`check_slots`) and :func:`pack`'s ``out_idx`` (each chunk's last flat
    token; a chunk read from its slot is one token, so that is its token): a flat token's slot
    when it is read from there (else the padding slot), each output row's slot (padding rows:
    the padding slot)."""
    pad = buf.shape[0] - 1
    tok_src = np.full(n_flat, pad, np.int32)
    out_slot = np.full(out_idx.shape[0], pad, np.int32)
    if slot_of is not None:
        out_slot[: len(slot_of)] = slot_of
        fed = [i for i, f in enumerate(from_slot) if f]
        tok_src[out_idx[fed]] = np.asarray(slot_of, np.int32)[fed]
    return tok_src, out_slot


def lens_used(chunks, starts, ps: int) -> tuple[list[int], list[int]]:
    """Each chunk's tokens, and the pages its positions up to the chunk's end take."""
    lens = [int(np.shape(c)[0]) for c in chunks]
    return lens, [-(-(int(s) + n) // ps) for s, n in zip(starts, lens)]


def step_rows(lens: list[int], starts: list[int], qb: int) -> tuple[list, list]:
    """The attention rows of a packed step, per group (prefill query blocks, decode tokens):
    ``(chunk, offset in the chunk, tokens, first query's position, keys the row sees)``."""
    groups: tuple[list, list] = ([], [])
    for i, (n, s0) in enumerate(zip(lens, starts)):
        rows = groups[0] if n > 1 else groups[1]
        rows.extend((i, j, min(qb, n - j), s0 + j, s0 + min(j + qb, n)) for j in range(0, n, qb))
    return groups


def shared_blocks(rows: list, page_ids, kb: int, span: int) -> int:
    """Leading key blocks the rows of a group all read (the same pages) and all see whole
    (every row's first query lies past them): computed once for the group (cascade), not once
    a row. 0 for fewer than two requests' rows (nothing to share)."""
    if len({r[0] for r in rows}) < 2:
        return 0
    cand = min(r[3] for r in rows) // span
    if cand == 0:
        return 0
    ref = np.asarray(page_ids[rows[0][0]][: cand * kb])
    for i in {r[0] for r in rows}:
        diff = np.flatnonzero(np.asarray(page_ids[i][: cand * kb]) != ref)
        if diff.size:
            cand = min(cand, int(diff[0]) // kb)
            if cand == 0:
                return 0
            ref = ref[: cand * kb]
    return cand


def plan(
    cfg: ModelConfig,
    lens: list[int],
    starts: list[int],
    page_ids,
    ps: int,
    qb: int,
    key_block: int,
    min_pages: int,
    min_batch: int,
) -> tuple[tuple, tuple]:
    """The packed step's layout: ``(key, ((prefill rows, their shared blocks), (decode rows,
    theirs)))``, rows as :func:`step_rows` gives them.

    The key is what decides the step's shapes (see :func:`pack`): the config, the flat prefill
    and decode slots, the prefill rows, the query block, the work items of each group (a row's
    key blocks of ``kb`` pages, ``key_block`` tokens rounded down to whole pages, up to its last
    query, minus the group's shared blocks; at least ``min_pages`` pages' worth), the shared
    blocks of each group, and ``kb``."""
    pre, dec = step_rows(lens, starts, qb)
    kb = max(1, key_block // ps)
    span, min_items = kb * ps, -(-min_pages // kb)
    nd = 0 if not dec else bucket(len(dec)) if pre else fine_bucket(len(dec), min_batch)
    items, shared = [], []  # per group: its rows' own work items, its shared blocks
    # Work items bucket as the group's rows do: the decode group's beside a prefill by powers
    # of two (the shapes a mixed step compiles stay few).
    for rows, fit in ((pre, fine_bucket), (dec, bucket if pre else fine_bucket)):
        sh = shared_blocks(rows, page_ids, kb, span)
        w = sum(-(-r[4] // span) - sh for r in rows)
        items += [fit(w, min_items) if rows else 0, fine_bucket(sh) if sh else 0]
        shared.append(sh)
    key = (
        cfg,
        fine_bucket(sum(n for n in lens if n > 1), min_batch) if pre else 0,
        nd,
        fine_bucket(len(pre)) if pre else 0,
        qb,
        *items,
        kb,
    )
    return key, ((pre, shared[0]), (dec, shared[1]))


def pack(chunks, starts, page_ids, lens, used, ps, scratch, key, rows):
    """Host arrays of :meth:`DecoderModel.forward_batch`'s packed step of layout ``key, rows``
    (:func:`plan`): flat tokens, their positions and K/V pages, the row groups
    ``((src, item_row, item_pages, item_k0, shared_pages, shared_k0), ...)``, each token's
    slot, and each chunk's last flat token (``[prefill rows + decode rows]``; padding repeats
    row 0).

    The flat tokens are the prefill chunks' (padded to ``fine_bucket`` of their count), then one
    slot per decode row (``fine_bucket`` rows in a decode-only step, a power of two beside a
    prefill): a full token budget plus the decode rows does not jump to the next bucket, and
    the shapes a mixed step compiles stay few. A row's work items are its request's pages in
    blocks of ``kb``, up to the page of its last query, after the group's shared blocks
    (padding items and padding shared blocks see nothing)."""
    _, np_, nd, rp, qb, wp, sp, wd, sd, kb = key
    span = kb * ps
    never = 1 << 30  # the first key of a padding item: past every position
    nflat = np_ + nd
    toks = np.zeros(nflat, np.int32)
    pos = np.zeros(nflat, np.int32)
    wpage = np.full(nflat, scratch, np.int32)
    tok_slot = np.zeros(nflat, np.int32)
    out_idx = np.zeros(rp + nd, np.int32)
    first = {}  # chunk -> its first flat token: prefill chunks first, then the decode tokens
    for group, off in ((True, 0), (False, np_)):
        for i, n in enumerate(lens):
            if (n > 1) != group:
                continue
            p = np.arange(starts[i], starts[i] + n, dtype=np.int32)
            toks[off : off + n] = chunks[i]
            pos[off : off + n] = p
            wpage[off : off + n] = np.asarray(page_ids[i], np.int32)[p // ps]
            out_idx[i] = off + n - 1
            first[i] = off
            off += n
    groups, base = [], 0
    (pre, sh_pre), (dec, sh_dec) = rows
    for rows, sh, tq, r, w, ws in ((pre, sh_pre, qb, rp, wp, sp), (dec, sh_dec, 1, nd, wd, sd)):
        if not rows:
            continue
        src = np.empty((r, tq), np.int32)
        item_row = np.zeros(w, np.int32)
        item_pages = np.full((w, kb), scratch, np.int32)
        item_k0 = np.full(w, never, np.int32)
        sh_pages = np.full((ws, kb), scratch, np.int32)
        sh_k0 = np.full(ws, never, np.int32)
        if sh:
            sh_pages[:sh] = np.asarray(page_ids[rows[0][0]][: sh * kb], np.int32).reshape(sh, kb)
            sh_k0[:sh] = np.arange(sh, dtype=np.int32) * span
        slots = np.arange(tq, dtype=np.int32)
        it = 0
        for k, (i, j, n, _, keys) in enumerate(rows):
            f = first[i] + j
            src[k] = f + np.minimum(slots, n - 1)  # padding slots repeat the last token
            tok_slot[f : f + n] = base + k * tq + slots[:n]
            n_it = -(-keys // span)
            pages = np.full(n_it * kb, scratch, np.int32)
            m = min(used[i], n_it * kb)
            pages[:m] = np.asarray(page_ids[i][:m], np.int32)
            own = n_it - sh
            item_pages[it : it + own] = pages.reshape(n_it, kb)[sh:]
            item_row[it : it + own] = k
            item_k0[it : it + own] = np.arange(sh, n_it, dtype=np.int32) * span
            it += own
        src[len(rows) :] = src[0]
        groups.append((src, item_row, item_pages, item_k0, sh_pages, sh_k0))
        base += r * tq
    return toks, pos, wpage, tuple(groups), tok_slot, out_idx


def flatten(arrays: tuple) -> tuple[tuple, np.ndarray]:
    """``(layout, blob)``: the step's int32 host arrays as one flat buffer and their shapes
    (the jitted step's static argument; ``layers.unpack`` slices them back). One host -> device
    transfer a step instead of one per array (~10 us each on CPU, ~20 arrays a step)."""
    layout = tuple(a.shape for a in arrays)
    return layout, np.concatenate([np.asarray(a, np.int32).reshape(-1) for a in arrays])
