"""Process groups: how the caches of several ``jax.distributed`` processes agree (ARCHITECTURE.md,
"Several processes").

A cache whose pools span the devices of several processes runs one copy of the tree per
process; every decision that could differ between them (a transfer seen complete, an L3
result, a clock reading) is first *agreed* through the cache's group, so that every process
changes its tree the same way. A group has one primitive, :meth:`Group.allgather` (each process
contributes a string, every process gets all of them, in process order); the rest
(:meth:`Group.agree_min`, :meth:`Group.check_equal`, :meth:`Group.leader`) is built on it.

- :class:`LocalGroup`: one process; every agreement is the value itself, no communication.
- :class:`DistributedGroup`: the processes of ``jax.distributed``. Two transports:
  ``"socket"`` (default; ``memory/group_socket.py``): direct TCP connections between the
  processes, their addresses published once through the key-value store of
  ``jax.distributed``'s coordination service; ``"kv"``: every agreement through that store (one
  ``key_value_set`` and ``num_processes - 1`` blocking gets; the keys deleted a block of steps
  at a time). Both, unlike a device collective, wait with a deadline: a peer that died or
  stopped calling makes the others raise :class:`GroupTimeoutError` naming it, within
  ``timeout_s``. Each agreement carries a tag (what the call is); peers at the same step with
  different tags made different calls, and :class:`GroupDivergedError` says so.

This module (and ``group_socket.py``, which it hands the store) is the only one that touches
``jax.distributed``'s client (a private module of jax:
``jax._src.distributed.global_state.client``; jax has no public key-value API).

Threading: the cache's thread only (steps are numbered per group).
"""

from __future__ import annotations

import collections
import itertools
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hicache_jax.errors import (
    GroupDivergedError,
    GroupTimeoutError,
    HiCacheError,
)
from hicache_jax.memory.group_socket import SocketLinks, call_diverged, route_host

__all__ = ["Group", "LocalGroup", "DistributedGroup", "AgreedClock", "default_group"]


class Group:
    """What a cache needs of its processes. Subclasses define :meth:`allgather`."""

    process_id: int = 0
    num_processes: int = 1
    #: agreements made so far, and the seconds spent in them (waiting for the peers
    #: included); none with one process
    calls: int = 0
    seconds: float = 0.0

    def allgather(self, tag: str, value: str) -> list[str]:
        """Every process's ``value`` of this step, in process order (all must call it)."""
        raise NotImplementedError

    def ride(self, name: str, value: Callable[[], str], take: Callable[[list[str]], None]) -> None:
        """Send ``value()`` with the next agreement, whatever it is for, and give ``take``
        every process's (in process order) once it is in: a value that can wait for the next
        agreement costs none of its own (:meth:`flush` sends it alone). Every process must ask
        for the same riders in the same order. One process: ``take([value()])`` now."""
        take([value()])

    def flush(self) -> None:
        """Send the riders still waiting, in an agreement of their own (none: nothing)."""

    def close(self) -> None:
        """Release what the group holds (connections); nothing for one process."""

    def agree_min(self, tag: str, values: Sequence[int]) -> np.ndarray:
        """Elementwise MIN over processes of int ``values`` (same length everywhere)."""
        mine = np.asarray(values, np.int64).reshape(-1)
        if self.num_processes == 1:
            return mine
        rows = [
            np.asarray([int(x) for x in v.split(",") if x], np.int64)
            for v in self.allgather(tag, ",".join(map(str, mine.tolist())))
        ]
        if any(r.shape != mine.shape for r in rows):
            raise GroupDivergedError(
                f"agree_min {tag!r}: processes gave {[r.size for r in rows]} values", field=tag
            )
        return np.min(np.stack(rows), axis=0)

    def leader(self, tag: str, value: str) -> str:
        """Process 0's ``value`` (a broadcast from the leader)."""
        if self.num_processes == 1:
            return value
        return self.allgather(tag, value)[0]

    def check_equal(self, tag: str, fields: Sequence[tuple[str, str]]) -> None:
        """Raise :class:`GroupDivergedError` on every process, naming the first field
        (in ``fields`` order) whose value differs between processes, and both values."""
        if self.num_processes == 1:
            return
        names = [name for name, _ in fields]
        rows = [v.split("\x1f") for v in self.allgather(tag, "\x1f".join(v for _, v in fields))]
        if any(len(r) != len(names) for r in rows):
            raise GroupDivergedError(f"{tag}: processes compared different field lists", field=tag)
        for i, name in enumerate(names):
            values = [r[i] for r in rows]
            odd = next((p for p, v in enumerate(values) if v != values[0]), None)
            if odd is None:
                continue
            first, other = values[0], values[odd]
            if values[0].startswith("{"):  # a JSON dict (the counters): name its first key
                name, first, other = _first_key(name, values[0], values[odd])
            raise GroupDivergedError(
                f"{tag}: {name} differs between processes: process 0 has {first}, "
                f"process {odd} has {other}",
                field=name,
            )


def _first_key(name: str, a: str, b: str) -> tuple[str, str, str]:
    """The first key (sorted) whose value differs between two JSON dicts, and both values."""
    da, db = json.loads(a), json.loads(b)
    key = next(k for k in sorted(set(da) | set(db)) if da.get(k) != db.get(k))
    return f"{name}.{key}", str(da.get(key, 0)), str(db.get(key, 0))


class LocalGroup(Group):
    """One process: every agreement is the local value."""

    def allgather(self, tag: str, value: str) -> list[str]:
        return [value]

    def __repr__(self) -> str:
        return "LocalGroup()"


# Groups built in one process are numbered in construction order, which the processes share
# (they build their caches alike), so the n-th group of each process names the same keys.
_GROUP_NUMBERS = itertools.count()


class DistributedGroup(Group):
    """The processes of ``jax.distributed`` (``jax.distributed.initialize`` first).

    Args:
        timeout_s: how long an agreement waits for a peer before :class:`GroupTimeoutError`.
        name: the key namespace; the same on every process (default: ``hicache/<n>`` for the
            n-th group built in the process).
        client, process_id, num_processes: tests inject these (default: jax.distributed's).
        delete_every: ``"kv"``: this process's keys are deleted this many steps at a time (one
            delete of their directory: a round trip to the store saved on the other steps).
        transport: ``"socket"`` (default): agreements over direct TCP connections
            (:class:`~hicache_jax.memory.group_socket.SocketLinks`); ``"kv"``: through the
            key-value store.
        host, port: ``"socket"``: the address this process listens on and publishes to its
            peers (default host: this host's interface that routes to the coordinator,
            127.0.0.1 for a local one; port 0: an ephemeral one). The listener closes once
            every peer has connected.
    """

    def __init__(
        self,
        timeout_s: float = 60.0,
        *,
        name: str | None = None,
        client: Any = None,
        process_id: int | None = None,
        num_processes: int | None = None,
        delete_every: int = 64,
        transport: str = "socket",
        host: str | None = None,
        port: int = 0,
    ) -> None:
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be a number > 0")
        if not isinstance(delete_every, int) or delete_every < 1:
            raise ValueError(f"delete_every={delete_every!r} must be an int >= 1")
        if transport not in ("socket", "kv"):
            raise ValueError(f"transport={transport!r} must be 'socket' or 'kv'")
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"port={port!r} must be an int in [0, 65536)")
        self._every = delete_every
        coordinator = None
        if client is None:
            import jax
            from jax._src import distributed  # jax has no public key-value store API

            client = distributed.global_state.client
            if client is None:
                raise HiCacheError("DistributedGroup needs jax.distributed.initialize(...) first")
            process_id, num_processes = jax.process_index(), jax.process_count()
            coordinator = distributed.global_state.coordinator_address
        elif process_id is None or num_processes is None:
            raise TypeError("an injected client needs process_id and num_processes too")
        self._client, self.timeout_s = client, float(timeout_s)
        self.process_id, self.num_processes = int(process_id), int(num_processes)
        self._ns = name if name is not None else f"hicache/{next(_GROUP_NUMBERS)}"
        self._step = 0
        self.seconds = 0.0  # spent in allgather (the agreement's share of a run)
        self.calls = 0
        self.calls_by_tag: collections.Counter[str] = collections.Counter()
        self._riders: list[tuple[str, Callable[[], str], Callable[[list[str]], None]]] = []
        self.transport = transport
        self._links = None
        if transport == "socket" and self.num_processes > 1:
            self._links = SocketLinks(
                client,
                self._ns,
                self.process_id,
                self.num_processes,
                host=host or route_host(coordinator),
                port=port,
                timeout_s=self.timeout_s,
            )

    def __repr__(self) -> str:
        return (
            f"DistributedGroup(process {self.process_id} of {self.num_processes}, "
            f"{self._ns!r}, {self.transport}, timeout_s={self.timeout_s})"
        )

    def close(self) -> None:
        """Close the socket transport's connections (peers then see this process gone)."""
        if self._links is not None:
            self._links.close()

    def ride(self, name: str, value: Callable[[], str], take: Callable[[list[str]], None]) -> None:
        self._riders.append((name, value, take))

    def flush(self) -> None:
        if self._riders:
            self.allgather("riders", "")

    def allgather(self, tag: str, value: str) -> list[str]:
        t0 = time.perf_counter()
        step = self._step
        self._step += 1
        riders, self._riders = self._riders, []
        # the riders are part of the call: a peer with other riders made other calls
        wire = tag + "".join(f"+{name}" for name, _, _ in riders)
        mine = "\x1d".join([value] + [v() for _, v, _ in riders])
        if self._links is not None:
            rows = self._links.exchange(step, wire, mine)
        else:
            rows = self._kv_exchange(step, wire, mine)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.calls_by_tag[tag] += 1
        if not riders:
            return rows
        parts = [r.rsplit("\x1d", len(riders)) for r in rows]
        for j, (_, _, take) in enumerate(riders):
            take([q[1 + j] for q in parts])
        return [q[0] for q in parts]

    def _kv_exchange(self, step: int, wire: str, mine: str) -> list[str]:
        """The ``"kv"`` transport's step: set this process's key, get every peer's."""
        me = self.process_id
        self._client.key_value_set(self._key(step, me), f"{wire}\x1e{mine}")
        end = time.monotonic() + self.timeout_s
        rows = []
        for p in range(self.num_processes):
            rows.append(mine if p == me else self._get(step, p, wire, end))
        if step and step % self._every == 0:
            # Every peer has read our keys of the steps before this one (it set this step's
            # key after): those of the last block of steps go, in one delete of their directory.
            self._client.key_value_delete(f"{self._ns}/{step // self._every - 1}/{me}")
        return rows

    def _key(self, step: int, p: int) -> str:
        """Process ``p``'s key of ``step``: under its directory of the step's block."""
        return f"{self._ns}/{step // self._every}/{p}/{step}"

    def _get(self, step: int, p: int, tag: str, end: float) -> str:
        ms = max(1, int((end - time.monotonic()) * 1000))
        try:
            raw = self._client.blocking_key_value_get(self._key(step, p), ms)
        except Exception as e:  # jax's runtime error type varies with its version
            raise GroupTimeoutError(
                f"process {p} of {self.num_processes} did not reach agreement step {step} "
                f"({tag!r}) within {self.timeout_s:g} s: it died, hangs, or stopped calling "
                f"the cache (process {self.process_id} waited; {type(e).__name__})",
                process=p,
            ) from None
        peer_tag, _, value = raw.partition("\x1e")
        if peer_tag != tag:
            raise call_diverged(step, self.process_id, tag, p, peer_tag)
        return value


class AgreedClock:
    """The clock of a cache over several processes: the leader's clock, read at each
    :meth:`sync` (the cache's: where a request starts, ``match_prefix`` and ``prefetch``) and
    carried by the next agreement, plus one nanosecond per reading since, so that every process
    reads the same strictly increasing values when it makes the same calls (access stamps, pin
    expiry and L3 deadlines then decide alike). Stamps (``clock()``) need only the order, so
    they read the last reading in; deadlines and ttls (:meth:`fresh`) wait for this request's.

    Args:
        group: the processes.
        local: this process's time source (only the leader's readings are used).
    """

    def __init__(self, group: Group, local: Any) -> None:
        self._group, self._local = group, local
        self._now = (
            float(local())
            if group.num_processes == 1
            else float(group.leader("clock", repr(float(local()))))
        )
        self._last = self._now - 1e-9
        self._pending = False

    def sync(self) -> None:
        """Take the leader's clock with the group's next agreement (:meth:`Group.ride`: the
        request's first transfer or L3 agreement carries it), or in one of its own at the
        first :meth:`fresh` reading before that. Every process makes the same calls, so the
        choice is the same on each."""
        if not self._pending:
            self._pending = True
            self._group.ride("clock", lambda: repr(float(self._local())), self._take)

    def _take(self, readings: list[str]) -> None:
        self._pending = False
        self._now = max(float(readings[0]), self._last + 1e-9)

    def __call__(self) -> float:
        """A stamp (eviction keys): the last agreed reading, ticking on; it orders alike on
        every process, whether or not this request's reading is in yet."""
        self._last = max(self._now, self._last + 1e-9)
        return self._last

    def fresh(self) -> float:
        """A reading for a deadline or a ttl (seconds matter): this request's reading of the
        leader's clock, agreed now if no agreement has carried it yet."""
        if self._pending:
            self._group.flush()
        return self()


def default_group(timeout_s: float = 60.0) -> Group:
    """:class:`LocalGroup` in a single process, else a :class:`DistributedGroup`."""
    import jax

    if jax.process_count() == 1:
        return LocalGroup()
    return DistributedGroup(timeout_s)
