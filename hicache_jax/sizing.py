"""Pool sizes from bytes: the pages, window pages and state slots that each tier's bytes hold
for a model, split by the cache's default rule (ARCHITECTURE.md, "Sizing pools by bytes").

A serving stack knows its memory in bytes: so many GiB of accelerator memory for L1, so many of
pinned host memory for L2. ``HiCacheConfig`` counts pages, and a model with layer groups
(``KVSpec.window_groups``) has pools of three kinds per tier: full-attention pages (what the
tree counts), each window group's pages and each recurrent group's state slots, all
preallocated arrays of their own. :func:`size_pools` splits each tier's bytes between them:

- a plain spec (one full-attention group): ``bytes // spec.page_bytes`` pages;
- window groups (sliding-window or chunked layers): the window pool holds the pages of the
  longest prompt (on L1: a request's own pages hold every group's page until it enters the
  tree), plus ``k = ceil(W / page_size)`` pages for every mean prompt's pages of the
  full-attention pool beside them (the tails the tree keeps: a node's end reads its last ``k``
  pages); at most one window page a full-attention page;
- ``STATE`` groups (recurrent layers): one request's checkpoints on L1 plus one slot per mean
  prompt's pages (two with interior checkpoints), at least 8, at most one a page;
- both kinds at once: both demands, solved together;
- given the workload's working set (``working_set_tokens``, with window groups): no
  full-attention pool holds more pages than it and the longest prompt; beside an L2 that would
  hold it all, L1 is split as the all-full model's where L2 copies every page L1 evicts (not
  under write-through at a threshold above 1: ``write_through_selective``'s default), and
  under a write policy that backs up what L1 evicts (``clean_ahead``, ``write_back``) both
  tiers together hold at most it (the bytes past it in window pages).

The rules are the replay's (:func:`hicache_jax.replay.windows.tier_pools`,
:func:`hicache_jax.replay.states.tier_slots`, :func:`hicache_jax.replay.mixed.tier_pools`):
``hicache-jax replay --layer-pattern`` measures what they serve at equal memory against the
all-full model (benchmarks/RESULTS.md, "Layer groups", "Recurrent state"). The split is fixed
when the pools are built: a split that suits one workload can cost another's hits, which a
notebook can measure with the replay's ``--window-share`` / ``--state-share``.

Threading: plain functions and values.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hicache_jax.spec import (
    GroupKind,
    HiCacheConfig,
    KVSpec,
    WritePolicy,
    default_write_through_threshold,
)
from hicache_jax.validation import check_int, parse_enum

__all__ = ["PoolSizes", "SIZED_FIELDS", "default_host_bytes", "size_pools"]

#: The ``HiCacheConfig`` fields :meth:`PoolSizes.config` sets (a caller's own value for one of
#: them is refused: the sizes come from the bytes).
SIZED_FIELDS = frozenset(
    {
        "device_pages",
        "host_pages",
        "host_ratio",
        "window_device_pages",
        "window_host_pages",
        "state_device_slots",
        "state_host_slots",
        "checkpoint_every_pages",
    }
)


@dataclasses.dataclass(frozen=True)
class PoolSizes:
    """Each tier's pools for a byte budget (:func:`size_pools`).

    Attributes:
        device_pages, host_pages: full-attention pages of L1 and L2.
        window_device_pages, window_host_pages: pages of each window group's pool (None: the
            spec has no sliding-window or chunked group, or the tier has no bytes).
        state_device_slots, state_host_slots: state slots of each ``STATE`` group (None: no
            such group, or the tier has no bytes).
        checkpoint_every_pages: the interval of interior checkpoints the split was made for
            (None: the cache's default for the spec).
        device_bytes, host_bytes: the bytes these pools take on each tier (at most the
            budget's; the rest is less than a page or a slot).
        write_policy: the write policy the pools were sized for where it mattered (with a
            working set: whether the two tiers are capped together), else None; the config
            gets it.
        write_through_threshold: with a working set, the write-through threshold the pools
            were sized for (a write-through policy's, its default where none was given:
            whether L2 copies every page L1 evicts), or the one given; else None. The config
            gets it.
    """

    device_pages: int
    host_pages: int
    window_device_pages: int | None
    window_host_pages: int | None
    state_device_slots: int | None
    state_host_slots: int | None
    checkpoint_every_pages: int | None
    device_bytes: int
    host_bytes: int
    write_policy: WritePolicy | None = None
    write_through_threshold: int | None = None

    def config(self, **fields: Any) -> HiCacheConfig:
        """A ``HiCacheConfig`` with these pools and ``fields`` (any other field of it).

        Raises:
            TypeError: a field of :data:`SIZED_FIELDS` given (the sizes come from the bytes).
            ValueError: ``write_policy`` or ``write_through_threshold`` other than the one the
                pools were sized for.
            Whatever ``HiCacheConfig`` raises for the other fields.
        """
        clash = sorted(SIZED_FIELDS & set(fields))
        if clash:
            raise TypeError(
                f"{clash[0]} is set by size_pools from the bytes: pass the bytes instead, or "
                "build HiCacheConfig(...) yourself"
            )
        if self.write_policy is not None and "write_policy" in fields:
            policy = parse_enum(WritePolicy, "write_policy", fields.pop("write_policy"))
            if policy is not self.write_policy:
                raise ValueError(
                    f"write_policy={policy.value!r}, but these pools were sized for "
                    f"{self.write_policy.value!r} (with a working set the tiers are capped "
                    "together or not by it): pass write_policy to size_pools"
                )
        threshold = self.write_through_threshold
        if threshold is not None and "write_through_threshold" in fields:
            given = fields.pop("write_through_threshold")
            if given != threshold:
                raise ValueError(
                    f"write_through_threshold={given!r}, but these pools were sized for "
                    f"{threshold} (with a working set, L1's split follows whether L2 copies "
                    "every page L1 evicts): pass write_through_threshold to size_pools"
                )
        return HiCacheConfig(**self.config_fields(), **fields)

    def config_fields(self) -> dict[str, Any]:
        """The ``HiCacheConfig`` fields of these pools (None: the config's default)."""
        return {
            "device_pages": self.device_pages,
            "host_pages": self.host_pages,
            "window_device_pages": self.window_device_pages,
            "window_host_pages": self.window_host_pages,
            "state_device_slots": self.state_device_slots,
            "state_host_slots": self.state_host_slots,
            "checkpoint_every_pages": self.checkpoint_every_pages,
        } | {
            k: v
            for k, v in (
                ("write_policy", self.write_policy),
                ("write_through_threshold", self.write_through_threshold),
            )
            if v is not None
        }


def size_pools(
    spec: KVSpec,
    device_bytes: int,
    host_bytes: int | None = None,
    *,
    longest_prompt_tokens: int | None = None,
    mean_prompt_tokens: int | None = None,
    checkpoint_every_pages: int | None = None,
    working_set_tokens: int | None = None,
    write_policy: WritePolicy | str | None = None,
    write_through_threshold: int | None = None,
) -> PoolSizes:
    """Split ``device_bytes`` of L1 and ``host_bytes`` of L2 between ``spec``'s pools by the
    default rule (module docstring); ``.config(...)`` gives the ``HiCacheConfig``.

    Args:
        spec: the model's KV layout.
        device_bytes: bytes for L1's pools, all of them (with a mesh: over every device).
        host_bytes: bytes for L2's pools; None: :func:`default_host_bytes`; 0: no L2.
        longest_prompt_tokens: the most tokens one request holds (a stack's longest admitted
            prompt; where requests run in batches, the batch's tokens: a running request's own
            pages hold every group's page). Needed with window or ``STATE`` groups.
        mean_prompt_tokens: the mean prompt the stack expects, in tokens (at most
            ``longest_prompt_tokens``): the tree keeps about one node end per mean prompt, each
            reading ``k`` window pages or a checkpoint. Needed with window or ``STATE`` groups.
        checkpoint_every_pages: with ``STATE`` groups, the interval of interior checkpoints
            the split is made for (``HiCacheConfig.checkpoint_every_pages``; None: the cache's
            default), passed on to the config.
        working_set_tokens: with sliding-window or chunked groups, the distinct tokens the
            stack's workload keeps coming back to (what a replay takes as a trace's distinct
            pages), or None: no cap. Given, no full-attention pool holds more pages than that
            plus the longest prompt's, the bytes past it in window pages; where L2's alone
            would, L1 is split as the all-full model's; where only both together would, both
            give up the pages past it in proportion where the write policy makes the tiers
            one cache of their summed size (the replay's rule with a trace's distinct pages,
            ``hicache_jax.replay.windows.split_tiers`` and ``summed_tiers``).
        write_policy: with ``working_set_tokens``, the write policy the cache will run
            (None: ``HiCacheConfig``'s default); the result's ``config()`` gets it.
        write_through_threshold: with ``working_set_tokens``, the cache's
            ``write_through_threshold`` (None: the write policy's default): a write-through
            policy above 1 backs up only pages hit that often, so L2 does not hold every page
            L1 evicts (``hicache_jax.replay.windows.l2_keeps_evicted``); ``config()`` gets it.

    Raises:
        TypeError: ``spec`` not a ``KVSpec``; a count not an int.
        ValueError: naming the argument: a negative or zero budget, prompt lengths missing
            where the spec needs them or inconsistent, ``checkpoint_every_pages`` without a
            ``STATE`` group, ``working_set_tokens`` without a sliding-window or chunked
            group, ``write_policy`` not one or without ``working_set_tokens``,
            ``write_through_threshold`` below 1 or without ``working_set_tokens``, or a tier
            too small to hold one full-attention page beside the windows or slots the rule
            keeps (the bytes it needs are in the message).
    """
    if not isinstance(spec, KVSpec):
        raise TypeError(f"spec must be a KVSpec, got {type(spec).__name__}")
    device_bytes = check_int("device_bytes", device_bytes, 1)
    if host_bytes is None:
        host_bytes = default_host_bytes(device_bytes)
    host_bytes = check_int("host_bytes", host_bytes, 0)
    kinds = {g.kind for g in spec.window_groups}
    stateful = GroupKind.STATE in kinds
    windowed = bool(kinds - {GroupKind.STATE})
    if checkpoint_every_pages is not None:
        if not stateful:
            raise ValueError(
                "checkpoint_every_pages applies to STATE groups (recurrent layers): the spec "
                "has none"
            )
        checkpoint_every_pages = check_int("checkpoint_every_pages", checkpoint_every_pages, 0)
    distinct, policy, threshold = _working_set(
        spec, windowed, working_set_tokens, write_policy, write_through_threshold
    )
    longest = mean = 0
    if stateful or windowed:
        longest, mean = _prompts(longest_prompt_tokens, mean_prompt_tokens)
    sizes = _split(
        spec,
        (device_bytes, host_bytes),
        stateful,
        windowed,
        longest,
        mean,
        checkpoint_every_pages,
        distinct,
        policy,
        threshold,
    )
    tiers: list[tuple[int, int | None, int | None, int]] = []
    for (name, budget), (n_f, n_w, n_s) in zip(
        (("device", device_bytes), ("host", host_bytes)), sizes
    ):
        if budget == 0:
            tiers.append((0, None, None, 0))
            continue
        used = _bytes(spec, n_f, n_w, n_s)
        if n_f < 1 or (n_w is not None and n_w < 1) or used > budget:
            least = max(used, _least_bytes(spec))
            beside = ", with the window pages or state slots the rule keeps" * bool(
                spec.window_groups
            )
            raise ValueError(
                f"{name}_bytes={budget} is too small for this spec: it needs at least "
                f"{least} bytes (one full-attention page{beside})"
            )
        tiers.append((n_f, n_w, n_s, used))
    (df, dw, ds, dused), (hf, hw, hs, hused) = tiers
    return PoolSizes(
        device_pages=df,
        host_pages=hf,
        window_device_pages=dw,
        window_host_pages=hw,
        state_device_slots=ds,
        state_host_slots=hs,
        checkpoint_every_pages=checkpoint_every_pages,
        device_bytes=dused,
        host_bytes=hused,
        write_policy=policy,
        write_through_threshold=threshold,
    )


def default_host_bytes(device_bytes: int) -> int:
    """L2's bytes when none are given: ``HiCacheConfig``'s default ``host_ratio`` times L1's."""
    return int(round(HiCacheConfig.host_ratio * device_bytes))


def _prompts(longest: Any, mean: Any) -> tuple[int, int]:
    """The prompt lengths, checked (both needed, ``1 <= mean <= longest``)."""
    if longest is None or mean is None:
        raise ValueError(
            "longest_prompt_tokens and mean_prompt_tokens are needed to split the bytes of a "
            "spec with window or STATE groups (the window pages and slots it keeps follow them)"
        )
    longest = check_int("longest_prompt_tokens", longest, 1)
    mean = check_int("mean_prompt_tokens", mean, 1)
    if mean > longest:
        raise ValueError(
            f"mean_prompt_tokens={mean} must be at most longest_prompt_tokens={longest}"
        )
    return longest, mean


def _split(
    spec: KVSpec,
    budgets: tuple[int, int],
    stateful: bool,
    windowed: bool,
    longest: int,
    mean: int,
    every: int | None,
    distinct: int | None,
    write_policy: WritePolicy | None,
    threshold: int | None,
) -> list[tuple[int, int | None, int | None]]:
    """``(N_f, N_w, N_s)`` of L1 and L2 (None: no such pool; a tier of no bytes ``(0, None,
    None)``): a window spec's both tiers at once (the working set's caps look at both,
    :func:`hicache_jax.replay.windows.split_tiers`), the others' tier by tier."""
    if not (stateful or windowed):
        return [(b // spec.page_bytes, None, None) for b in budgets]
    # (the rules' home is the replay's, which measures them; imported here, not at import
    # time: the replay package imports the cache)
    from hicache_jax.replay import mixed, states, windows

    if not windowed:
        out: list[tuple[int, int | None, int | None]] = []
        for budget, requests in zip(budgets, (True, False)):
            if budget == 0:
                out.append((0, None, None))
                continue
            n_f, n_s = states.tier_slots(spec, budget, longest, mean, every, requests)
            out.append((n_f, None, n_s))
        return out
    policy = HiCacheConfig.write_policy if write_policy is None else write_policy
    if stateful:
        return list(
            mixed.split_tiers(
                spec,
                *budgets,
                window_share=None,
                state_share=None,
                longest_tokens=longest,
                mean_tokens=mean,
                every=every,
                distinct_pages=distinct,
                write_policy=policy,
                write_through_threshold=threshold,
            )
        )
    return [
        (n_f, n_w, None)
        for n_f, n_w in windows.split_tiers(
            spec,
            *budgets,
            longest_tokens=longest,
            mean_tokens=mean,
            distinct_pages=distinct,
            write_policy=policy,
            write_through_threshold=threshold,
        )
    ]


def _bytes(spec: KVSpec, n_f: int, n_w: int | None, n_s: int | None) -> int:
    """The bytes of a tier's pools."""
    from hicache_jax.replay import states, windows

    return (
        n_f * spec.page_bytes
        + (n_w or 0) * windows.window_page_bytes(spec)
        + (n_s or 0) * states.slot_bytes(spec)
    )


def _working_set(
    spec: KVSpec, windowed: bool, tokens: Any, write_policy: Any, threshold: Any
) -> tuple[int | None, WritePolicy | None, int | None]:
    """``(distinct pages, write policy, write-through threshold)`` of :func:`size_pools`'
    working set, checked (the threshold: the one given, else a write-through policy's
    default, else None); ``(None, None, None)`` without one."""
    if tokens is None:
        for name, value, what in (
            ("write_policy", write_policy, "whether the two tiers are capped together"),
            ("write_through_threshold", threshold, "whether L2 copies every page L1 evicts"),
        ):
            if value is not None:
                raise ValueError(
                    f"{name} applies with working_set_tokens ({what}); without one, pass it "
                    "to .config()"
                )
        return None, None, None
    if not windowed:
        raise ValueError(
            "working_set_tokens caps the full-attention pools beside window pools: the spec "
            "has no sliding-window or chunked group"
        )
    tokens = check_int("working_set_tokens", tokens, 1)
    policy = parse_enum(
        WritePolicy,
        "write_policy",
        HiCacheConfig.write_policy if write_policy is None else write_policy,
    )
    if threshold is not None:
        threshold = check_int("write_through_threshold", threshold, 1)
    elif policy in (WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_THROUGH_SELECTIVE):
        threshold = default_write_through_threshold(policy)
    return -(-tokens // spec.page_size), policy, threshold


def _least_bytes(spec: KVSpec) -> int:
    """One full-attention page, with one page of every window group and one checkpoint's
    slots where the spec has them."""
    from hicache_jax.replay import states, windows

    return spec.page_bytes + windows.window_page_bytes(spec) + states.slot_bytes(spec)
