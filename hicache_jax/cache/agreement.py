"""Agreement between the caches of several processes (ARCHITECTURE.md, "Several processes").

Each process of a ``jax.distributed`` run holds its own copy of the cache's tree and page
ownership; they must stay identical. Two checks compare them through the cache's group
(:mod:`hicache_jax.memory.group`), each raising ``GroupDivergedError`` (a ``HiCacheError``) on
every process, naming the first field that differs:

- :func:`config_fields` at construction: the spec and every setting (pages, policies, the mesh's
  shape); a cache built differently on one process fails before any pool is built.
- :class:`Agreement` (``HiCache.check_agreement()``, and at the start of every N-th public
  call with ``HiCacheConfig.agreement_check_every``, before it changes anything): digests of
  the tree (its shape, each tier's pages, locks, eviction keys), the device page owners, the
  host pages allocated, the transfers in flight, and the counters (timings excluded: they are
  measured, not decided).

Threading: the cache's thread only.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
import json
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from hicache_jax.cache.inflight import InFlight
from hicache_jax.cache.ownership import DevicePageOwners
from hicache_jax.memory.allocator import PageAllocator
from hicache_jax.memory.group import AgreedClock, Group, default_group
from hicache_jax.spec import HiCacheConfig, KVSpec
from hicache_jax.tree.radix import RadixTree

# compared by what they are, below; a storage URL by its scheme (hosts mount stores at paths
# of their own)
_NOT_COMPARED = ("group", "mesh", "prefill_cost", "storage")


def _show(value: Any) -> str:
    return str(value.value) if isinstance(value, enum.Enum) else repr(value)


def config_fields(spec: KVSpec, cfg: HiCacheConfig) -> list[tuple[str, str]]:
    """``(name, value)`` of everything that makes two processes' caches decide differently."""
    out = [
        (
            f"spec.{f.name}",
            spec.describe_groups() if f.name == "groups" else _show(getattr(spec, f.name)),
        )
        for f in dataclasses.fields(spec)
    ]
    out += [
        (f.name, _show(getattr(cfg, f.name)))
        for f in dataclasses.fields(cfg)
        if f.name not in _NOT_COMPARED
    ]
    mesh = cfg.mesh
    out.append(
        (
            "mesh",
            "None"
            if mesh is None
            else f"{dict(mesh.shape)} devices={np.asarray(mesh.device_ids).ravel().tolist()}",
        )
    )
    out.append(("storage", repr(None if cfg.storage is None else cfg.storage.split(":")[0])))
    cost = cfg.prefill_cost
    out.append(("prefill_cost", "None" if cost is None else getattr(cost, "__qualname__", "?")))
    return out


def check_config(group: Group, spec: KVSpec, cfg: HiCacheConfig) -> None:
    """At construction, before any pool is built: every process has the same spec and config
    (``GroupDivergedError`` naming the first field that differs), and none that decides from
    local timings (``load_policy="cost"`` fits each process's own measurements)."""
    if group.num_processes == 1:
        return
    if cfg.load_policy == "cost":
        raise ValueError(
            "load_policy='cost' decides from each process's own timings, which "
            f"differ between the {group.num_processes} processes: use 'threshold'"
        )
    group.check_equal("config", config_fields(spec, cfg))


def join_group(
    spec: KVSpec, cfg: HiCacheConfig, clock: Callable[[], float]
) -> tuple[Group, bool, Callable[[], float]]:
    """A cache's group, whether the cache owns it, and the clock of its tree. The group is
    ``cfg.group``, else :func:`default_group` (the cache's own: its ``close`` closes it, as
    does a construction that fails here); :func:`check_config` runs over it; with several
    processes the clock is the leader's (:class:`AgreedClock` over ``clock``)."""
    owned = cfg.group is None
    group = default_group(cfg.agreement_timeout_s) if owned else cfg.group
    try:
        check_config(group, spec, cfg)
        if group.num_processes > 1:
            clock = AgreedClock(group, clock)
    except BaseException:
        if owned:
            group.close()
        raise
    return group, owned, clock


def bind_completions(engine: Any, group: Group, lag: int | None) -> None:
    """How the transfer engine's copies count as complete (``HiCacheConfig.completion_lag``):
    at the ``lag``-th request start after their dispatch, on every process alike with no
    agreement (``TransferEngine.complete_after``); else, with several processes, once the
    MIN over processes says so at a request start (``TransferEngine.agree_with``); else when
    seen landed."""
    if lag is not None:
        engine.complete_after(lag)
    elif group.num_processes > 1:
        engine.agree_with(group)  # completions: the MIN over processes


def _digest(parts: Iterable[Any]) -> str:
    h = hashlib.blake2b(digest_size=12)
    for p in parts:
        h.update(p.tobytes() if isinstance(p, np.ndarray) else repr(p).encode())
        h.update(b"|")
    return h.hexdigest()


def state_fields(
    tree: RadixTree,
    owners: DevicePageOwners,
    host: PageAllocator,
    flight: InFlight,
    counters: collections.Counter,
    l3: Any = None,
) -> list[tuple[str, str]]:
    """``(name, digest)`` of one cache's decided state, in the order a difference is named
    (``l3``: the L3 slot, whose figures but the store's own are compared)."""
    nodes = list(tree.nodes())
    pid = lambda n: -1 if n.parent is None else n.parent.id  # noqa: E731
    none = np.zeros(0, np.int32)
    ops = list(flight.ops())
    kept = {k: v for k, v in sorted(counters.items()) if "seconds" not in k and v}
    l3_kept = (
        {}
        if l3 is None
        else {k: v for k, v in sorted(l3.stats().items()) if not k.startswith("l3_store_")}
    )
    return [
        (
            "tree.nodes",
            f"{len(nodes)}:"
            + _digest(x for n in nodes for x in (n.id, pid(n), n.key, n.extra_key)),
        ),
        ("tree.device_pages", _digest(n.value if n.value is not None else none for n in nodes)),
        (
            "tree.host_pages",
            _digest(n.host_value if n.host_value is not None else none for n in nodes),
        ),
        ("tree.locks", _digest((n.lock_ref, n.host_pins) for n in nodes)),
        ("tree.eviction_keys", _digest((n.hit_count, n.last_access, n.priority) for n in nodes)),
        ("device_page_owners", _digest([owners.owners()])),
        ("host_pages_allocated", _digest([host.is_allocated(np.arange(host.num_pages))])),
        (
            "in_flight",
            f"{len(ops)}:"
            + _digest(x for op in ops for x in (op.seq, op.kind.value, op.device_ids, op.host_ids)),
        ),
        ("counters", json.dumps(kept)),
        ("l3", json.dumps(l3_kept)),
    ]


class Agreement:
    """The agreement checks of one cache (built with its parts, again at ``reset()``).

    Args:
        group: the cache's processes.
        every: check after every ``every``-th public call (0: only when asked).
        tree, owners, host, flight, counters, l3: the cache's parts whose state is compared
            (:func:`state_fields`).
    """

    def __init__(
        self,
        group: Group,
        every: int,
        tree: RadixTree,
        owners: DevicePageOwners,
        host: PageAllocator,
        flight: InFlight,
        counters: collections.Counter,
        l3: Any,
    ) -> None:
        self.group, self._every = group, every
        self._parts = (tree, owners, host, flight, counters, l3)
        self._calls = 0

    def check(self, tag: str = "check_agreement") -> None:
        """Compare the state across processes (a no-op in one process). ``tag``: the call
        the processes are at (different calls at one step are named as such)."""
        if self.group.num_processes > 1:
            self.group.check_equal(tag, state_fields(*self._parts))

    def before_call(self, name: str) -> None:
        """A public call ``name`` starts: check at every ``every``-th one, before it changes
        anything (a call that raises leaves the cache as it was)."""
        if self._every:
            self._calls += 1
            if self._calls % self._every == 0:
                self.check(f"before {name}")
