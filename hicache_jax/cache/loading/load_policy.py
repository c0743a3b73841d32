"""Which part of a host chain a load-back loads (ARCHITECTURE.md, "Load or recompute").

A rule's ``step()`` gives the decision function of one ``load_back`` / ``load_back_many`` call:
``decide(chain) -> j``, load the first ``j`` nodes of the host-only ``chain`` (root-first; 0:
decline, the whole chain recomputed). The threshold rule loads all or nothing
(``load_back_threshold``, ``load_back_quota``); the cost rule asks the cost model, within the
per-request cap and the step's token budget, and falls back to the threshold rule where the
model has no usable prefill figure. Where the model's plan ends inside a node (a probe of a
few pages of an unmeasured link, cache/loading/cost_model.py), the cost rule splits that node
there (``RadixTree.trim_tail``), so the chain's first nodes hold exactly the planned pages. Where
the caller can overlap a load with its prefill (``overlap``, set by ``HiCache.begin`` under
``HiCacheConfig(load_overlap=True)``), the model may pick a two-ended split: the chain is
declined in the tree (``decide`` gives 0) and :meth:`CostRule.take_split` gives the caller the
front's tokens; the caller loads the back into its own pages (cache/loading/overlap.py).

Pure bookkeeping over the tree (no jax); the cache's thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hicache_jax.cache.loading.cost_model import CostModel, Fetch
from hicache_jax.errors import HiCacheError
from hicache_jax.memory.allocator import PageAllocator
from hicache_jax.spec import HiCacheConfig
from hicache_jax.tree.node import TreeNode
from hicache_jax.tree.radix import RadixTree

__all__ = ["CostRule", "ThresholdRule", "make_rule"]

#: ``decide(chain, resident)``: how many of the host ``chain``'s first nodes to load;
#: ``resident``: tokens of device pages before the chain that only its load makes servable
#: (``Match.resident_len``: window or STATE groups), served with it, copied by nothing.
Decide = Callable[[list[TreeNode], int], int]


class ThresholdRule:
    """All of a chain that serves at least ``threshold`` tokens (its own and the resident ones
    before it: ``Match.host_len``) and loads at most ``quota``, else nothing."""

    def __init__(self, threshold: int, quota: int | None) -> None:
        self.threshold, self.quota = threshold, quota

    def decide(self, chain: list[TreeNode], resident: int = 0) -> int:
        ntok = sum(n.num_tokens for n in chain)
        ok = ntok + resident >= self.threshold and (self.quota is None or ntok <= self.quota)
        return len(chain) if ok else 0

    def step(self) -> Decide:
        return self.decide

    def fetch_pages(self, new_pages: int, covered: int) -> int:
        """An L3 prefetch fetches every page L3 holds (the prefetch policies bound its wait)."""
        return new_pages

    def fetch_decision(self) -> None:
        """No model decided the fetch: no record."""
        return None


def _cached_tokens(chain: list[TreeNode]) -> int:
    """Tokens of the device prefix above a host chain."""
    n, node = 0, chain[0].parent
    while node is not None and node.parent is not None:
        n += node.num_tokens
        node = node.parent
    return n


class CostRule:
    """The cost model's least-time split, capped per request and per step."""

    def __init__(
        self,
        model: CostModel,
        fallback: ThresholdRule,
        device: PageAllocator,
        max_tokens: int | None,
        step_budget: int | None,
        tree: RadixTree | None = None,
    ) -> None:
        self.model, self.fallback, self.device, self.tree = model, fallback, device, tree
        self.max_tokens, self.step_budget = max_tokens, step_budget
        self._decided: dict = {}
        self._fetch: Fetch | None = None  # the last fetch decision: L3 figures, plan
        # set by a caller that executes two-ended splits (HiCache.begin with load_overlap);
        # a split chain is declined in the tree and its front's tokens kept here
        self.overlap = False
        self.splits: dict[TreeNode, int] = {}
        #: with window or STATE groups (``Windows.load_ends``): for a chain, a function of
        #: ``ntok`` giving, of a load of its first ``ntok`` tokens, the longest that serves;
        #: the model prices each candidate as that load (``CostModel.plan``'s ``ends``), so it
        #: picks among loads that serve (a probe still goes where it must: it measures the
        #: link, serving or not)
        self.servable: Callable[[list[TreeNode]], Callable[[int], int]] | None = None

    def step(self) -> Decide:
        left = [self.step_budget]
        free = [self.device.num_free]
        decided: dict[TreeNode, Any] = {}  # chain root -> its Decision (None: fell back)
        self._decided = decided
        self.splits = {}

        def decide(chain: list[TreeNode], resident: int = 0) -> int:
            cap = self.max_tokens
            if left[0] is not None:
                cap = left[0] if cap is None else min(cap, left[0])
            if resident:  # (see below)
                decided[chain[0]] = None
                return whole(chain, resident, cap)
            ntok = self.model.plan(
                [n.num_tokens for n in chain],
                _cached_tokens(chain),
                free[0],
                cap,
                overlap=self.overlap,
                ends=None if self.servable is None else self.servable(chain),
            )
            if ntok is not None and self.model.last_split is not None:
                self.splits[chain[-1]] = self.model.last_split  # the caller loads the back
                pages = ntok // self.model.page_size
                free[0] = max(0, free[0] - pages)
                if left[0] is not None:
                    left[0] -= ntok
                return 0
            j = None if ntok is None else self._nodes_for(chain, ntok)  # may split chain[0]
            decided[chain[0]] = None if ntok is None else self.model.last_decision
            if j is None:
                return whole(chain, 0, cap)
            return spend(chain, j)

        def whole(chain: list[TreeNode], resident: int, cap: int | None) -> int:
            """The threshold rule's decision, within the caps. Where resident device pages
            come before the chain, only it: the model prices a chain whose device prefix
            serves (a part loaded serves as far as it goes, a decline recomputes the chain),
            while there a part serves only where its end holds what the resident pages lack,
            and a decline recomputes them too."""
            j = self.fallback.decide(chain, resident)
            if cap is not None and sum(n.num_tokens for n in chain) > cap:
                j = 0
            return spend(chain, j)

        def spend(chain: list[TreeNode], j: int) -> int:
            loaded = sum(n.num_tokens for n in chain[:j])
            pages = sum(n.num_pages for n in chain[:j])
            free[0] = max(0, free[0] - pages)
            if left[0] is not None:
                left[0] -= loaded
            return j

        return decide

    def take_split(self, node: TreeNode) -> int | None:
        """The front's tokens of the two-ended split the last step decided for the host chain
        ending at ``node`` (None: none); the caller then loads the back
        (cache/loading/overlap.py)."""
        return self.splits.pop(node, None)

    def _nodes_for(self, chain: list[TreeNode], ntok: int) -> int:
        """The number of ``chain``'s first nodes holding its first ``ntok`` tokens; where that
        ends inside a node, the node is split there (in the tree, and ``chain`` in place: the
        caller loads ``chain[:j]``), else (a locked node, no tree) the nodes before it."""
        cum = 0
        for i, node in enumerate(chain):
            if cum + node.num_tokens > ntok:
                if ntok > cum and self.tree is not None:
                    try:
                        tail = (cum + node.num_tokens - ntok) // self.model.page_size
                        self.tree.trim_tail(node, tail)
                    except HiCacheError:
                        return i
                    head = node.parent  # the split's head, now node's parent
                    assert head is not None
                    chain.insert(i, head)
                    return i + 1
                return i
            cum += node.num_tokens
        return len(chain)

    def fetch_pages(self, new_pages: int, covered: int) -> int:
        """Of ``new_pages`` pages an L3 prefetch could fetch beyond the ``covered`` tokens L1 +
        L2 hold, the cost model's least-time number over both hops (L3 -> L2 -> L1), within
        ``max_load_tokens``; every page where the model has no usable prefill figure (the
        threshold rule's fetch, counted as the model counts it). It probes only the L3 link
        (load-backs probe L2 -> L1)."""
        ps = self.model.page_size
        cap = None if self.max_tokens is None else self.max_tokens // ps * ps
        self._fetch = None
        j = self.model.plan(
            [ps] * new_pages,
            covered,
            self.device.num_free,
            cap,
            links=("l3_l2", "l2_l1"),
            probe=("l3_l2",),
        )  # load-backs probe L2
        if j is None:
            return new_pages if cap is None else min(new_pages, cap // ps)
        j //= ps
        if j == 0:  # a decision to recompute: its prediction is checked against the prefill
            self.model.track([(self.model.last_decision, 0)])
        else:  # a decision to fetch: its read's predicted time is checked when it lands
            self._fetch = Fetch(*self.model.fetch_figures(), self.model.last_decision)
        return j

    def fetch_decision(self) -> Fetch | None:
        """The L3 link's ``(latency, bytes/s)`` the last :meth:`fetch_pages` decided a fetch
        on, with the plan's decision (None: it fell back or fetched nothing):
        ``CostModel.settle_fetch`` checks it."""
        return self._fetch

    def dispatched(self, accepted: list[list[TreeNode]]) -> None:
        """The chains the last step's load dispatched (in its order): their decisions, and
        those of the chains it declined, wait for their actual times
        (cache/loading/cost_model.py)."""
        taken = {c[0]: c for c in accepted}
        out = [
            (d, self.model.load_nbytes(sum(n.num_pages for n in taken[root])))
            for root, d in self._decided.items()
            if root in taken
        ]
        out += [
            (d, 0)
            for root, d in self._decided.items()
            if root not in taken and d is not None and d.nbytes == 0
        ]
        self.model.track(out)
        self._decided = {}


def make_rule(
    cfg: HiCacheConfig, model: CostModel, device: PageAllocator, tree: RadixTree | None = None
) -> ThresholdRule | CostRule:
    """The rule ``cfg.load_policy`` names (the device allocator: free pages, for the cost
    model's eviction charge; the tree: where a probe splits a node)."""
    threshold = ThresholdRule(cfg.load_back_threshold, cfg.load_back_quota)
    if cfg.load_policy != "cost":
        return threshold
    return CostRule(
        model, threshold, device, cfg.max_load_tokens, cfg.load_step_budget_tokens, tree
    )
