"""KVSpec (what one page holds) and HiCacheConfig (sizes, policies, thresholds).

Both are frozen dataclasses validated at construction: a bad field raises ``ValueError`` /
``TypeError`` naming the field. Policy strings are resolved once into ``str`` enums here, so
``cfg.write_policy == "write_back"`` still reads naturally while the code dispatches on enums.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any

import ml_dtypes  # jax's own dtypes package: the KV dtypes without importing jax
import numpy as np

from hicache_jax.validation import check_bool, check_int, is_int, is_real, parse_enum

#: KV dtypes the pools accept -> the unsigned integer of the same width the pools store.
_BITS_DTYPE = {
    "bfloat16": np.uint16,
    "float16": np.uint16,
    "float32": np.uint32,
    "float8_e4m3fn": np.uint8,
    "int8": np.uint8,
}
SUPPORTED_DTYPES = tuple(_BITS_DTYPE)


class EvictionPolicy(str, enum.Enum):
    """Which node to evict first. A ``str`` enum: ``EvictionPolicy.LRU == "lru"``."""

    LRU = "lru"  # least recently used
    LFU = "lfu"  # least frequently used, ties by recency
    FIFO = "fifo"  # oldest node first
    MRU = "mru"  # most recently used first
    FILO = "filo"  # newest node first
    PRIORITY = "priority"  # lowest request priority first, ties by recency
    SLRU = "slru"  # segmented LRU: probationary (hit_count < 2) before protected

    @classmethod
    def parse(cls, value: str | EvictionPolicy) -> EvictionPolicy:
        """Turn a user string into the enum, with an error that lists the choices."""
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(p.value for p in cls)
            raise ValueError(f"eviction={value!r} is not one of: {choices}") from None


class WritePolicy(str, enum.Enum):
    """When device pages are backed up to host (SGLang HiCache semantics)."""

    WRITE_THROUGH = "write_through"  # once hit_count >= threshold (default 1)
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # same, default threshold 2
    WRITE_BACK = "write_back"  # only when evicted from device
    CLEAN_AHEAD = "clean_ahead"  # the eviction end of L1, in the background; L2 ~ exclusive


class HostLayout(str, enum.Enum):
    """Layout of the host pool buffer."""

    LAYER_FIRST = "layer_first"  # [num_layers, kv, num_pages, page_size, heads, dim]
    PAGE_FIRST = "page_first"  # [num_pages, num_layers, kv, page_size, heads, dim]


class CopyBackend(str, enum.Enum):
    """How the device pool moves pages: XLA scatter/gather, or Pallas kernels."""

    AUTO = "auto"
    XLA = "xla"
    PALLAS = "pallas"


class PrefetchPolicy(str, enum.Enum):
    """How match_prefix treats an L3 prefetch still in flight."""

    BEST_EFFORT = "best_effort"
    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"


@dataclasses.dataclass(frozen=True)
class KVSpec:
    """Shape and dtype of the KV cache of one model.

    Args:
        num_layers: transformer layers.
        num_kv_heads: KV heads (1 for an MLA latent cache).
        head_dim: head dimension (the latent width for MLA).
        dtype: one of ``SUPPORTED_DTYPES``.
        page_size: tokens per page.
        mla: K and V are one tensor (a latent cache); the KV axis then has size 1.
        shard: which kv heads of a larger cache these pages hold ("" for all): the spec of
            one process's share of a cache sharded over several processes (``"2:4/8"``:
            heads 2 to 4 of 8). Part of the fingerprint when set, so L3 keys carry the shard
            and a different process count is a miss.

    The KV of ``n`` pages, as every public API takes and returns it, has shape
    ``kv_shape(n) = (num_layers, kv_factor, n, page_size, num_kv_heads, head_dim)``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    page_size: int = 16
    mla: bool = False
    shard: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):  # stored as int
            object.__setattr__(self, name, check_int(name, getattr(self, name), 1))
        dtype: Any = self.dtype  # a str once built; the constructor takes a numpy/jax dtype too
        if not isinstance(dtype, str):
            try:
                dtype = np.dtype(dtype).name  # accept jnp.bfloat16 / np.float16 too
            except TypeError:
                raise TypeError(
                    f"dtype={self.dtype!r} is not a dtype; use one of: "
                    f"{', '.join(SUPPORTED_DTYPES)}"
                ) from None
        if dtype not in _BITS_DTYPE:
            raise ValueError(f"dtype={self.dtype!r} is not one of: {', '.join(SUPPORTED_DTYPES)}")
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "mla", check_bool("mla", self.mla))
        if not isinstance(self.shard, str):
            raise TypeError(f"shard={self.shard!r} must be a str")
        if self.mla and self.num_kv_heads != 1:
            raise ValueError(
                f"mla=True needs num_kv_heads=1 (one latent 'head'), got {self.num_kv_heads}"
            )

    @property
    def kv_factor(self) -> int:
        """2 (K and V) or 1 (MLA latent)."""
        return 1 if self.mla else 2

    @property
    def jnp_dtype(self) -> np.dtype:
        """The compute dtype (``jnp.bfloat16`` etc.)."""
        return np.dtype(getattr(ml_dtypes, self.dtype, self.dtype))

    @property
    def bits_dtype(self) -> np.dtype:
        """Unsigned integer of the dtype's width: what the pools store (ARCHITECTURE.md: the
        pool is stored as raw bits)."""
        return np.dtype(_BITS_DTYPE[self.dtype])

    @property
    def itemsize(self) -> int:
        return self.bits_dtype.itemsize

    def kv_shape(self, num_pages: int) -> tuple[int, int, int, int, int, int]:
        """Shape of the KV of ``num_pages`` pages: [layers, kv, pages, page_size, heads, dim]."""
        return (
            self.num_layers,
            self.kv_factor,
            num_pages,
            self.page_size,
            self.num_kv_heads,
            self.head_dim,
        )

    def page_major_shape(self, num_pages: int) -> tuple[int, int, int, int, int, int]:
        """Shape of ``num_pages`` pages page-major (the ``page_first`` host layout, L3 entries):
        [pages, layers, kv, page_size, heads, dim]."""
        return (
            num_pages,
            self.num_layers,
            self.kv_factor,
            self.page_size,
            self.num_kv_heads,
            self.head_dim,
        )

    @property
    def page_elems(self) -> int:
        """Elements of one page across all layers and K/V."""
        return self.num_layers * self.kv_factor * self.page_size * self.num_kv_heads * self.head_dim

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers and K/V."""
        return self.page_elems * self.itemsize

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one page of one layer and one of K/V (contiguous in every layout)."""
        return self.page_size * self.num_kv_heads * self.head_dim * self.itemsize

    def fingerprint(self) -> str:
        """Stable short hash of everything that makes two caches' bytes incompatible."""
        text = (
            f"L{self.num_layers}/H{self.num_kv_heads}/D{self.head_dim}/{self.dtype}"
            f"/P{self.page_size}/mla{int(self.mla)}"
        )
        if self.shard:  # (unsharded keys stay what they were)
            text += f"/shard{self.shard}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @classmethod
    def parse(
        cls,
        text: str | None,
        default: KVSpec,
        *,
        page_size: int | None = None,
        flag: str = "--spec",
    ) -> KVSpec:
        """A spec from a command's ``--spec``: ``"layers=32,kv_heads=8,head_dim=128,
        dtype=bfloat16,page_size=16,mla=1"`` (comma-separated ``key=value`` items, any subset).

        Args:
            text: the items; None or empty: ``default`` itself (page size aside).
            default: where a key left out takes its value (``hicache-jax lower``: Llama-3-8B's
                KV; ``hicache-jax replay``: one layer, one head of 1, float32).
            page_size: the page size, when the command sets it by its own flag (``replay
                --page-size``): then ``page_size`` is not a key of ``text``.
            flag: the flag named in errors.

        Raises:
            ValueError: an item that is not ``key=value`` with a known key (naming the item and
                the keys), or an int key whose value is not an int; KVSpec's own checks.
        """
        keys = {
            "layers": "num_layers",
            "kv_heads": "num_kv_heads",
            "head_dim": "head_dim",
            "dtype": "dtype",
            "page_size": "page_size",
            "mla": "mla",
        }
        fields = dataclasses.asdict(default)
        if page_size is not None:
            del keys["page_size"]
            fields["page_size"] = page_size
        for item in filter(None, (text or "").split(",")):
            key, sep, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or key not in keys:
                raise ValueError(
                    f"{flag} item {item!r}: expected key=value with key one of {', '.join(keys)}"
                )
            name = keys[key]
            if name == "dtype":
                fields[name] = value
            elif name == "mla":
                fields[name] = value.lower() in ("1", "true", "yes")
            else:
                try:
                    fields[name] = int(value)
                except ValueError:
                    raise ValueError(f"{flag} {item!r}: {value!r} is not an int") from None
        return cls(**fields)


@dataclasses.dataclass(frozen=True)
class HiCacheConfig:
    """Sizes and policies of one HiCache.

    Args:
        device_pages: pages in the device pool (L1).
        host_pages: pages in the host pool (L2); None -> ``round(host_ratio * device_pages)``.
        host_ratio: used only when ``host_pages`` is None.
        write_policy: "clean_ahead" (the default) | "write_through" |
            "write_through_selective" | "write_back" (see hicache.py).
        write_through_threshold: backup once ``hit_count >= threshold``; None -> 1 for
            write_through, 2 for write_through_selective (unused by write_back).
        eviction: "lru" | "lfu" | "fifo" | "mru" | "filo" | "priority" | "slru".
        load_back_threshold: tokens; host hits shorter than this are recomputed instead.
        load_back_quota: tokens; host hits longer than this are declined (None: unlimited).
        load_policy: "threshold" (the default: ``load_back_threshold`` / ``load_back_quota``) |
            "cost" (per request, the part of the host hit to load that the fitted cost model
            predicts fastest, the rest recomputed; see cache/loading/cost_model.py).
        prefill_cost: "cost": the serving stack's ``(n_new, n_cached) -> seconds``; None: the
            fit of ``HiCache.observe_prefill`` samples.
        max_load_tokens: "cost": at most this many tokens loaded per request (None: no cap).
        load_step_budget_tokens: "cost": at most this many tokens loaded per
            ``load_back_many`` call (a batched admission step; None: no budget).
        cost_page_bytes: "cost": the bytes one page weighs in the cost model's link figures
            (None: the spec's ``page_bytes``). A cache whose spec stands in for a larger model
            (the what-if simulator's) passes the modelled model's page, so that the warm-up
            figure and the fitted bandwidth speak of the modelled bytes.
        load_overlap: "cost": the request handle (``HiCache.begin``) may take a two-ended
            split of a host chain: its front recomputed while its back is copied into the
            request's own pages (cache/loading/overlap.py); the serving loop prefills the front,
            waits for the copy (``Request.wait_overlap``), prefills the rest. Default False.
        host_layout: "layer_first" | "page_first".
        copy_backend: "auto" | "xla" | "pallas" (device pool page movement).
        huge_pages: CPU backend: back both pools with transparent huge pages (Linux; ~2 ms
            per MiB at construction on the project's CPU machine, scattered copies ~10% faster;
            see hugepages.py and benchmarks/RESULTS.md).
        mesh: optional ``jax.sharding.Mesh``; the device pool is sharded over kv heads on
            ``shard_axis`` of it.
        shard_axis: mesh axis name; defaults to the mesh's first axis.
        storage: L3 URL ("file:///dir", "mooncake://host:port") or None.
        prefetch_policy: "best_effort" | "wait_complete" | "timeout".
        prefetch_timeout_s: base deadline of the "timeout" policy (grows with size).
        storage_write_policy: "write_through" (backed-up host pages also go to L3) |
            "write_back" (only host pages evicted from L2 go to L3).
        clean_ahead_pages: ``write_policy="clean_ahead"``: how many device pages at the
            eviction end of L1 are kept backed up ahead of eviction; None (the default): twice
            the largest allocation seen so far (alloc_pages / load_back), at least
            device_pages // 16 and at most device_pages // 2 (at least 1).
        kv_events: KV events, off by default (None: nothing recorded, ``take_events()``
            raises). A dict or its JSON string, like SGLang's ``--kv-events-config``:
            ``{"publisher": "queue"}`` keeps them for ``take_events()`` in-process;
            ``{"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events",
            "replay_endpoint": None, "buffer_steps": 10000}`` publishes them in vLLM's wire
            format (see events.py, events_zmq.py). Stored parsed, as a ``KVEventsConfig``.
        pin_max_share: the most of each pool (device, host) that ``HiCache.pin`` may hold, as a
            share of its pages (default 0.5: pins can never starve requests of more than half
            of a tier); a pin beyond it raises ``PinLimitError``.
        group: how the caches of several ``jax.distributed`` processes agree
            (``memory/group.py``); None: one process alone, else every process of
            ``jax.distributed`` (ARCHITECTURE.md, "Several processes").
        agreement_check_every: run ``HiCache.check_agreement()`` after every N-th public call
            (0: never; the tests use 1).
        agreement_timeout_s: how long an agreement waits for a peer process before
            ``GroupTimeoutError`` names it (the default group's timeout).
        completion_lag: None (default): a copy between L1 and L2 counts as done once it is
            seen landed (several processes: once every process has seen it, agreed at a
            request's start). An int K >= 1: it counts as done at the K-th request start
            (``match_prefix``, ``prefetch``) after its dispatch, waited for there if still
            moving, and at a wait; so what the cache decides depends on its calls alone, not
            on when copies land: every process decides alike with no agreement for it, and
            the same calls give the same decisions in every run. The price: a start whose
            copy of K starts ago is still moving waits for it (``stats()``:
            ``completion_lag_waits``, ``completion_lag_wait_seconds``); a larger K waits less
            and holds pages under copies longer (ARCHITECTURE.md, "Several processes").
    """

    device_pages: int
    host_pages: int | None = None
    host_ratio: float = 4.0
    write_policy: WritePolicy | str = WritePolicy.CLEAN_AHEAD
    write_through_threshold: int | None = None
    eviction: EvictionPolicy | str = EvictionPolicy.LRU
    load_back_threshold: int = 16
    load_back_quota: int | None = None
    load_policy: str = "threshold"
    prefill_cost: Any = None
    max_load_tokens: int | None = None
    load_step_budget_tokens: int | None = None
    cost_page_bytes: int | None = None
    load_overlap: bool = False
    host_layout: HostLayout | str = HostLayout.LAYER_FIRST
    copy_backend: CopyBackend | str = CopyBackend.AUTO
    huge_pages: bool = True
    mesh: Any = None
    shard_axis: str | None = None
    storage: str | None = None
    prefetch_policy: PrefetchPolicy | str = PrefetchPolicy.BEST_EFFORT
    prefetch_timeout_s: float = 1.0
    storage_write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH
    clean_ahead_pages: int | None = None
    kv_events: KVEventsConfig | dict | str | None = None
    pin_max_share: float = 0.5
    group: Any = None
    agreement_check_every: int = 0
    agreement_timeout_s: float = 60.0
    completion_lag: int | None = None

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("device_pages", check_int("device_pages", self.device_pages, 1))
        if self.host_pages is None:
            ratio = self.host_ratio
            if not is_real(ratio) or not math.isfinite(ratio) or ratio < 0:
                raise ValueError(f"host_ratio={self.host_ratio!r} must be a finite number >= 0")
            set_("host_pages", int(round(self.host_ratio * self.device_pages)))
        set_("host_pages", check_int("host_pages", self.host_pages, 0))
        set_("write_policy", parse_enum(WritePolicy, "write_policy", self.write_policy))
        set_("eviction", EvictionPolicy.parse(self.eviction))
        set_("host_layout", parse_enum(HostLayout, "host_layout", self.host_layout))
        set_("copy_backend", parse_enum(CopyBackend, "copy_backend", self.copy_backend))
        set_("huge_pages", check_bool("huge_pages", self.huge_pages))
        set_("prefetch_policy", parse_enum(PrefetchPolicy, "prefetch_policy", self.prefetch_policy))
        set_(
            "storage_write_policy",
            parse_enum(WritePolicy, "storage_write_policy", self.storage_write_policy),
        )
        if self.storage_write_policy is WritePolicy.CLEAN_AHEAD:
            raise ValueError(
                "storage_write_policy='clean_ahead' is not an L3 policy: use "
                "write_through, write_through_selective or write_back"
            )
        if self.clean_ahead_pages is not None:
            set_("clean_ahead_pages", check_int("clean_ahead_pages", self.clean_ahead_pages, 1))
        if self.write_through_threshold is None:
            default = 2 if self.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE else 1
            set_("write_through_threshold", default)
        set_(
            "write_through_threshold",
            check_int("write_through_threshold", self.write_through_threshold, 1),
        )
        set_("load_back_threshold", check_int("load_back_threshold", self.load_back_threshold, 0))
        if self.load_back_quota is not None:
            set_("load_back_quota", check_int("load_back_quota", self.load_back_quota, 0))
        if self.load_policy not in ("threshold", "cost"):
            raise ValueError(f"load_policy={self.load_policy!r} must be 'threshold' or 'cost'")
        if self.prefill_cost is not None and not callable(self.prefill_cost):
            raise TypeError(
                f"prefill_cost must be callable (n_new, n_cached) -> seconds, got "
                f"{type(self.prefill_cost).__name__}"
            )
        for name in ("max_load_tokens", "load_step_budget_tokens"):
            if getattr(self, name) is not None:
                set_(name, check_int(name, getattr(self, name), 0))
        if self.cost_page_bytes is not None:
            set_("cost_page_bytes", check_int("cost_page_bytes", self.cost_page_bytes, 1))
        check_bool("load_overlap", self.load_overlap)
        if self.load_overlap and self.load_policy != "cost":
            raise ValueError(
                "load_overlap=True needs load_policy='cost' (the split is the cost "
                "model's decision)"
            )
        if self.storage is not None and not isinstance(self.storage, str):
            raise TypeError(f"storage={self.storage!r} must be a URL string or None")
        timeout = self.prefetch_timeout_s
        if not is_real(timeout) or math.isnan(timeout) or timeout <= 0:
            raise ValueError(f"prefetch_timeout_s={self.prefetch_timeout_s!r} must be > 0")
        set_("kv_events", parse_kv_events(self.kv_events))
        share = self.pin_max_share
        if not is_real(share) or not 0.0 <= share <= 1.0:
            raise ValueError(f"pin_max_share={share!r} must be a number in [0, 1]")
        set_(
            "agreement_check_every",
            check_int("agreement_check_every", self.agreement_check_every, 0),
        )
        t = self.agreement_timeout_s
        if not is_real(t) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"agreement_timeout_s={t!r} must be a finite number > 0")
        if self.completion_lag is not None:
            set_("completion_lag", check_int("completion_lag", self.completion_lag, 1))
        if self.shard_axis is not None and self.mesh is None:
            raise ValueError(f"shard_axis={self.shard_axis!r} given without a mesh")
        if self.mesh is not None:
            names = tuple(self.mesh.axis_names)
            axis = self.shard_axis if self.shard_axis is not None else names[0]
            if axis not in names:
                raise ValueError(f"shard_axis={axis!r} is not an axis of the mesh {names}")
            set_("shard_axis", axis)


# -- kv_events configuration -----------------------------------------------------------------

_ENDPOINT = re.compile(
    r"^(tcp://(\*|[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):(\d{1,5})|ipc://.+|inproc://.+)$"
)


@dataclass(frozen=True)
class KVEventsConfig:
    """``HiCacheConfig(kv_events=...)``, parsed and checked (like SGLang's ``--kv-events-config``).

    Attributes:
        publisher: "queue" (in-process ``take_events()``) | "zmq" (vLLM's wire format).
        endpoint: zmq: the PUB socket's address, bound by the cache ("tcp://*:5557",
            "tcp://127.0.0.1:5557", "ipc:///tmp/kv").
        topic: zmq: the first frame of every message.
        replay_endpoint: zmq: a ROUTER address for replay requests, or None.
        buffer_steps: batches kept (queue: waiting to be taken; zmq: waiting for the
            publisher thread, and again sent, for replay).
        buffer_bytes: bytes those batches may hold (queue: their page hashes and tokens, see
            :func:`record_bytes`; zmq: the same while waiting, the encoded payloads for replay).
            Default 16 MiB: ~2M tokens of int64 keys, ~170 batches of 12K-token requests (with
            their host copies), a few hundred ms of a busy cache's events: enough for a
            consumer that takes them every scheduler step, and small beside the 200 MB over
            the pools that a long replay may use in all (``benchmarks/bench_memory.py``).
        data_parallel_rank: zmq: the ``data_parallel_rank`` of every batch.
        encoding: zmq: each event as vLLM's releases encode it: ``"map"`` (the default,
            vLLM's since PR #42892, in v0.26: a map of field names tagged by ``"type"``) or
            ``"array"`` (vLLM's earlier positional form). The batch is an array either way.
        l3_medium: announce L3 pages too, under this wire ``medium``: None (the default: L3
            is not announced, a router routes on L1 and L2), ``"auto"`` (``"DISK"`` for a
            ``file://`` store, ``"EXTERNAL"`` for a shared one) or a name of its own
            (``"STORAGE"``, ``"REMOTE"``, ...).
        block_hash: the ``block_hashes`` sent: ``"tree"`` (the tree's chained XXH3 page
            hashes) or the ids vLLM computes for the same tokens, ``"vllm:sha256"`` /
            ``"vllm:sha256_cbor"`` (see events/block_ids.py).
        hash_seed: vLLM ids: the seed of ``NONE_HASH`` (as vLLM's ``PYTHONHASHSEED``); None:
            ``PYTHONHASHSEED`` if set, else random (ids then match no other process).
    """

    publisher: str = "queue"
    endpoint: str = "tcp://*:5557"
    topic: str = "kv-events"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    buffer_bytes: int = 16 << 20
    data_parallel_rank: int = 0
    encoding: str = "map"
    l3_medium: str | None = None
    block_hash: str = "tree"
    hash_seed: str | None = None


_PUBLISHERS = ("queue", "zmq")
_ENCODINGS = ("map", "array")
_BLOCK_HASHES = ("tree", "vllm:sha256", "vllm:sha256_cbor")


def _check_endpoint(field: str, value: Any) -> None:
    m = _ENDPOINT.match(value) if isinstance(value, str) else None
    if m is None or (m.group(3) is not None and not 0 < int(m.group(3)) < 65536):
        raise ValueError(
            f"kv_events {field}={value!r} is not a ZMQ endpoint: use "
            "'tcp://HOST:PORT' (HOST '*' for every interface, PORT 1-65535), "
            "'ipc://PATH' or 'inproc://NAME'"
        )


def parse_kv_events(value: Any) -> KVEventsConfig | None:
    """``HiCacheConfig.kv_events`` (None, a dict, its JSON string or a KVEventsConfig) checked.

    Raises:
        ValueError / TypeError: naming the field (unknown publisher or key, malformed endpoint,
            buffer_steps or buffer_bytes not an int >= 1, ...).
    """
    if value is None or (isinstance(value, KVEventsConfig) and _checked(value)):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"kv_events={value!r} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise TypeError(
            f"kv_events={value!r} must be None, a dict or its JSON string, e.g. "
            '{"publisher": "zmq", "endpoint": "tcp://*:5557"}'
        )
    names = {f.name for f in dataclasses.fields(KVEventsConfig)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ValueError(f"kv_events has unknown field(s) {unknown}; known: {sorted(names)}")
    cfg = KVEventsConfig(**value)
    _checked(cfg)
    return cfg


def _checked(cfg: KVEventsConfig) -> bool:
    if cfg.publisher not in _PUBLISHERS:
        raise ValueError(
            f"kv_events publisher={cfg.publisher!r} is not one of: "
            f"{', '.join(map(repr, _PUBLISHERS))}"
        )
    for field, low in (("buffer_steps", 1), ("buffer_bytes", 1), ("data_parallel_rank", 0)):
        v = getattr(cfg, field)
        if not is_int(v) or v < low:
            raise ValueError(f"kv_events {field}={v!r} must be an int >= {low}")
    if not isinstance(cfg.topic, str):
        raise TypeError(f"kv_events topic={cfg.topic!r} must be a str")
    for field, allowed in (("encoding", _ENCODINGS), ("block_hash", _BLOCK_HASHES)):
        if getattr(cfg, field) not in allowed:
            raise ValueError(
                f"kv_events {field}={getattr(cfg, field)!r} is not one of: "
                f"{', '.join(map(repr, allowed))}"
            )
    for field in ("l3_medium", "hash_seed"):
        v = getattr(cfg, field)
        if v is not None and (not isinstance(v, str) or not v):
            raise TypeError(f"kv_events {field}={v!r} must be None or a non-empty str")
    _check_endpoint("endpoint", cfg.endpoint)
    if cfg.replay_endpoint is not None:
        _check_endpoint("replay_endpoint", cfg.replay_endpoint)
        if cfg.replay_endpoint == cfg.endpoint:
            raise ValueError(
                f"kv_events replay_endpoint={cfg.replay_endpoint!r} must differ from endpoint"
            )
    return True
