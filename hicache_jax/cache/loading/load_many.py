"""The load-back of one or several matches in one transfer (:meth:`HiCache.load_back`,
:meth:`HiCache.load_back_many`).

A batching scheduler admits several requests per step; their host-only prefixes go back to
device in one copy dispatch. Each match is decided as :meth:`HiCache.load_back` decides it,
taking the matches in list order: its chain is the host-only nodes ending at its node, cut at
the first node already accepted for an earlier match (duplicates and overlapping prefixes load
once, by the first), and the load rule (cache/loading/load_policy.py: threshold and quota, or
the cost model) decides how much of that chain, from its root end, is loaded. Device pages come from
one allocation for every accepted chain; when even eviction cannot cover it, chain by chain in
order, declining those that find none.

Pure bookkeeping over the tree (no jax); the cache's thread only (it locks tree nodes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hicache_jax.cache.l3_port import FetchedPages
from hicache_jax.cache.match import Match, NodeRef, current
from hicache_jax.errors import HiCacheError, OutOfPagesError
from hicache_jax.tree.node import TreeNode
from hicache_jax.tree.radix import RadixTree

__all__ = ["check_matches", "host_chain_after", "load_chains", "take_chains"]

#: ``(node, chain, device ids)`` of one accepted load: ``chain`` root-first, ``node`` locked.
Accepted = tuple[TreeNode, list[TreeNode], np.ndarray]


def check_matches(tree: RadixTree, matches: Any) -> None:
    """TypeError / HiCacheError for anything but a list or tuple of this tree's Matches
    (a deleted node's match is fine: it is matched again). Changes nothing."""
    if not isinstance(matches, (list, tuple)):
        raise TypeError(f"matches must be a list or tuple of Match, got {type(matches).__name__}")
    for i, m in enumerate(matches):
        if not isinstance(m, Match) or not isinstance(m.node, NodeRef):
            raise TypeError(
                f"matches[{i}] must be a Match from match_prefix, got {type(m).__name__}"
            )
        top = m.node._node
        while top.parent is not None:
            top = top.parent
        if top.is_root and top is not tree.root:
            raise HiCacheError(
                f"matches[{i}]: {m.node!r} is not in this cache (another "
                "cache's, or from before reset()): match again"
            )


def host_chain_after(node: TreeNode, claimed: set) -> list[TreeNode]:
    """The host-only nodes ending at ``node`` (root-first), stopping at a claimed one."""
    chain = []
    while node.parent is not None and node.value is None and node not in claimed:
        chain.append(node)
        node = node.parent
    chain.reverse()
    return chain


def _decide(
    nodes: list[TreeNode],
    rule: Any,
    take: Callable[[int], np.ndarray] | None,
    page_size: int,
    resident: Sequence[int],
) -> tuple[list, int]:
    """``([(node, chain, ids)], declined)``, ``chain`` the part of the node's host chain the
    rule loads (its first nodes); ``take(pages)`` allocates (None: decide only);
    ``resident``: each match's ``Match.resident_len`` (what the rule weighs with its chain)."""
    claimed: set = set()
    out, declined = [], 0
    decide = rule.step()
    for node, res in zip(nodes, resident):
        chain = host_chain_after(node, claimed)
        j = decide(chain, res) if chain else 0
        if not j:
            declined += bool(chain)
            continue
        chain = chain[:j]
        try:
            ids = None if take is None else take(sum(n.num_tokens for n in chain) // page_size)
        except OutOfPagesError:
            declined += 1
            continue
        claimed.update(chain)
        out.append((node, chain, ids))
    return out, declined


def take_chains(
    tree: RadixTree,
    nodes: list[TreeNode],
    *,
    rule: Any,
    take: Callable[[int], np.ndarray],
    page_size: int,
    resident: Sequence[int],
) -> tuple[list[Accepted], int]:
    """Decide every match's chain and allocate its device pages (``resident``: each match's
    ``Match.resident_len``).

    Every node is locked while pages are taken (eviction cannot reach a chain or its device
    ancestors); on return only the accepted loads' last nodes hold a lock (their load op's,
    released when the copy is acknowledged; a partly loaded chain's last node is locked anew).

    Returns:
        ``(accepted, declined)``: the accepted loads ``(last loaded node, chain, ids)`` in
        order, and how many chains were declined.
    """
    out, declined = _decide(nodes, rule, None, page_size, resident)
    if not out:  # nothing to load: no lock taken
        return out, declined
    for node in nodes:
        tree.lock(node)
    # Accepted nodes keep the lock taken here (they are distinct: a repeated node's chain is
    # claimed by its first occurrence); the others give theirs back.
    keep: list[TreeNode] = []
    try:
        need = sum(n.num_pages for _, chain, _ in out for n in chain)
        try:
            ids = take(need) if need else np.zeros(0, np.int32)
            cut, lo = [], 0
            for node, chain, _ in out:
                k = sum(n.num_pages for n in chain)
                cut.append((node, chain, ids[lo : lo + k]))
                lo += k
            out = cut
        except OutOfPagesError:
            out, declined = _decide(nodes, rule, take, page_size, resident)
        keep = [node for node, chain, _ in out if chain[-1] is node]
        for node, chain, _ in out:
            if chain[-1] is not node:  # a partial load: its op locks its own last node
                tree.lock(chain[-1])
        out = [(chain[-1], chain, ids) for _, chain, ids in out]
    finally:
        release = list(nodes)
        for node in keep:
            release.remove(node)
        for node in release:
            tree.unlock(node)
    return out, declined


def load_chains(
    tree: RadixTree,
    resolved: list[tuple[Match, TreeNode]],
    *,
    rule: Any,
    page_size: int,
    take: Callable[[int], np.ndarray],
    load: Callable[..., Any],
    counters: Any,
    layerwise: bool,
    fetched: FetchedPages | None = None,
) -> list[Match]:
    """Load the accepted chains of revalidated ``(match, node)`` pairs in ONE transfer
    (``load(pairs, ids, layerwise)``: the in-flight table's ``load``); what holds each prefix
    now, carrying the load's handle where it holds pages of the load and ``layerwise``, and
    (``Match.l3_len``) how many of the tokens loaded for it came from host pages an L3
    prefetch filled (``fetched``, whose tags the load then removes)."""
    accepted, declined = take_chains(
        tree,
        [node for _, node in resolved],
        rule=rule,
        page_size=page_size,
        take=take,
        resident=[m.resident_len for m, _ in resolved],
    )
    counters["load_backs_declined"] += declined
    loaded, handle = np.zeros(0, np.int32), None
    if accepted:
        loaded = np.concatenate([ids for _, _, ids in accepted])
        handle = load([(n, c) for n, c, _ in accepted], loaded, layerwise)
    dispatched = getattr(rule, "dispatched", None)  # the cost rule records its decisions
    if dispatched is not None:
        dispatched([c for _, c, _ in accepted])
    out = [current(m, node, page_size) for m, node in resolved]
    if accepted and fetched is not None and fetched.tagged:
        out = _count_l3(out, [m for m, _ in resolved], fetched, page_size)
    if accepted and layerwise:
        out = [
            dataclasses.replace(m, load_handle=handle)
            if np.isin(m.device_pages, loaded).any()
            else m
            for m in out
        ]
    return out


def _loaded_host_pages(before: Match, after: Match, page_size: int) -> np.ndarray:
    """The host pages of the nodes ``after``'s device prefix gained over ``before``'s (the
    loaded ones keep their host copies), deepest node first."""
    tokens = after.device_len - before.device_len - before.resident_len
    node = after.node._anchor
    parts = []
    while tokens > 0 and node.parent is not None:
        k = min(node.num_tokens, tokens) // page_size
        if node.host_value is not None and k:
            parts.append(node.host_value[-k:])
        tokens -= node.num_tokens
        node = node.parent
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def _count_l3(
    after: list[Match], before: list[Match], fetched: FetchedPages, page_size: int
) -> list[Match]:
    """``after`` with each match's ``l3_len``: its loaded tokens on pages ``fetched`` tags
    (each match counts the pages it was served from, shared ones too); then the tags of every
    page served are removed."""
    out, served = [], []
    for b, a in zip(before, after):
        ids = _loaded_host_pages(b, a, page_size)
        k = fetched.tagged_in(np.unique(ids)) if ids.size else 0
        out.append(dataclasses.replace(a, l3_len=k * page_size) if k else a)
        served.append(ids)
    fetched.take(np.unique(np.concatenate(served)))
    return out
