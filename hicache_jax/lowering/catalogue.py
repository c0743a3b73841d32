"""Every device program the cache and the reference engine compile, as shapes only.

:func:`programs` lists, for one :class:`~hicache_jax.spec.KVSpec`, pool size and platform, the
jitted functions the code dispatches with the arguments it would give them, each argument a
``jax.ShapeDtypeStruct`` (nothing is allocated, so a pool of many GiB costs nothing):

* the device pool's donated scatter (``write``) and gather (``read``) at every power-of-two page
  bucket :func:`~hicache_jax.memory.page_copy.bucket_size` maps a call of ``1 .. device_pages``
  pages to, with the XLA copy functions the pool picks on that platform and, on TPU and CUDA, with
  the Pallas kernels (``copy_backend="pallas"``); the Pallas layer-wise scatter; the two
  per-call helpers (``take_first``, ``pad``) once each;
* the host pool's staged write and read (``STAGE_SIZES``) and the transfer engine's backup,
  load and layer-wise load at every copy-plan length (``index_len``), with the host pool in
  ``pinned_host`` memory on accelerators (a 1-device mesh of this machine's device carries the
  memory kinds: lowering needs no device of the target platform);
* with window groups (``KVSpec.window_groups``), each group's pool programs and transfer
  copies as above, at the group's page shape, named ``window{g}.*`` (a layer-wise load's
  groups use them), and the copies of every group in one program (``transfer.fused_*``: what
  backups and other loads dispatch);
* a patterned model's (``KVSpec.from_pattern``) engine steps over the full pool and the window
  pools at once (``DevicePagePool.run_with``; its layer-wise steps are not listed);
* the serial engine's prefill and decode steps (fused: a ``lax.scan`` over stacked layers, and
  unrolled for steps of few tokens), its per-layer step (layer-wise load-back) and the batched
  engine's packed step (a mixed prefill + decode step, and a decode-only one). These run the
  model's real host code (:meth:`DecoderModel.forward` / ``forward_batch``) against a pool
  that records what it is given. The model is Llama-3-8B (weights as shapes) when the spec is
  its KV, else a small decoder of the spec's KV (see :func:`engine_model`).

Each operation's programs are the distinct argument shapes over every call size, so their count
is what the process compiles; :data:`ProgramSet.bounds` holds the bound each must stay within.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hicache_jax.engine.batched import BatchedEngine
from hicache_jax.engine.engine import Engine
from hicache_jax.engine.layers import LAYER
from hicache_jax.engine.model import DecoderModel, step_records_kept
from hicache_jax.engine.packing import TokenSlots, bucket
from hicache_jax.engine.weights import ModelConfig, abstract_params
from hicache_jax.memory import device_pool, host_pool, page_copy, transfer
from hicache_jax.memory.page_copy import STAGE_SIZES, bucket_size, index_len, stage_chunks
from hicache_jax.spec import GroupKind, HostLayout, KVSpec

#: Platforms the programs are listed for ("cpu" too: what this machine itself would run).
PLATFORMS = ("tpu", "cuda", "cpu")

#: Llama-3-8B's KV cache: 32 layers, 8 kv heads of 128, bfloat16, pages of 16 tokens (2 MiB).
LLAMA3_8B_KV = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
#: Llama-3-8B's decoder (its weights are only ever shapes here: 16 GB in bfloat16).
LLAMA3_8B = ModelConfig(
    vocab_size=128256,
    num_layers=32,
    d_model=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    ffn_dim=14336,
    rope_theta=500000.0,
    dtype="bfloat16",
)


@dataclasses.dataclass(frozen=True)
class Program:
    """One device program: a jitted function and the (abstract) arguments the code gives it.

    Attributes:
        name: unique, e.g. ``"device_pool.write[xla,64p,uint16]"``.
        op: the operation it is one size of (``"device_pool.write[xla]"``): the unit of the
            compile-count bound.
        fn: the ``jax.jit`` function the code dispatches.
        args: positional arguments (``jax.ShapeDtypeStruct`` leaves; static ones as values).
        kwargs: keyword (static) arguments.
        donated: flat argument 0 is a pool that must come back aliased to an output.
        pool_shapes: shapes of the pools the program touches, which must stay raw bits (no
            float tensor of that shape, no convert of one).
        kernel: a Pallas kernel, which must lower to its custom call.
        pages: pages the program moves (0: not a page copy).
        moved_bytes: bytes it moves (pages x page bytes), 0 for a model step.
    """

    name: str
    op: str
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)
    donated: bool = True
    pool_shapes: tuple = ()
    kernel: bool = False
    pages: int = 0
    moved_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class ProgramSet:
    """The programs of one spec, pool size and platform.

    Attributes:
        spec, platform, device_pages, host_pages: what they were listed for.
        programs: every :class:`Program`.
        bounds: operation -> the most distinct programs it may compile (power-of-two buckets
            up to the pool: ``bucket_size(pages).bit_length()`` sizes; ``len(STAGE_SIZES)``
            for the host pool's staging). Operations not in it (the engine's steps, bucketed
            in two dimensions, and the per-call helpers) are listed by representative shapes.
        model: the engine steps' ModelConfig (None: no engine steps for this spec).
        notes: what was left out and why.
    """

    spec: KVSpec
    platform: str
    device_pages: int
    host_pages: int
    programs: tuple[Program, ...]
    bounds: dict[str, int]
    model: ModelConfig | None
    notes: tuple[str, ...]


def _sds(shape: tuple, dtype: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(int(d) for d in shape), dtype, sharding=sharding)


def _i32(*shape: int) -> jax.ShapeDtypeStruct:
    return _sds(shape, jnp.int32)


def _buckets(n: int) -> list[int]:
    """The page buckets ``DevicePagePool`` pads a call of 1 .. n pages to (its own function)."""
    return sorted({bucket_size(k) for k in range(1, n + 1)})


def _bound(n: int) -> int:
    """Powers of two 1 .. bucket_size(n): the most bucketed programs an operation may have."""
    return bucket_size(n).bit_length()


# ----------------------------------------------------------------------------- device pool


def device_pool_programs(
    spec: KVSpec, device_pages: int, platform: str, backend: str
) -> tuple[list[Program], dict[str, int]]:
    """The pool's write (pages in bits or in the KV dtype) and read (as the KV dtype or as
    bits) at every bucket, with ``backend``'s copy functions on ``platform``."""
    scatter, gather = device_pool.platform_copy_fns(backend, platform)
    pool_shape = spec.kv_shape(device_pages + 1)
    pool = _sds(pool_shape, spec.bits_dtype)
    kernel = backend == "pallas"
    progs, bits, kv = [], np.dtype(spec.bits_dtype), np.dtype(spec.jnp_dtype)
    for b in _buckets(device_pages):
        ids, moved = _i32(b), b * spec.page_bytes
        for dt in dict.fromkeys((bits, kv)):
            progs.append(
                Program(
                    f"device_pool.write[{backend},{b}p,{dt.name}]",
                    f"device_pool.write[{backend}]",
                    device_pool.PROGRAMS["write"],
                    (pool, ids, _sds(spec.kv_shape(b), dt)),
                    dict(scatter=scatter, sharding=None),
                    True,
                    (pool_shape,),
                    kernel,
                    b,
                    moved,
                )
            )
            progs.append(
                Program(
                    f"device_pool.read[{backend},{b}p,{dt.name}]",
                    f"device_pool.read[{backend}]",
                    device_pool.PROGRAMS["read"],
                    (pool, ids),
                    dict(gather=gather, dtype=dt, sharding=None),
                    False,
                    (pool_shape,),
                    kernel,
                    b,
                    moved,
                )
            )
    n_dt = len({bits, kv})
    bounds = {
        f"device_pool.{op}[{backend}]": n_dt * _bound(device_pages) for op in ("write", "read")
    }
    return progs, bounds


def pool_helper_programs(spec: KVSpec, device_pages: int) -> list[Program]:
    """``take_first`` and ``pad``: one call's pages only (compiled per distinct page count by
    design, never pool-sized), at one representative count."""
    n = max(1, device_pages // 2 + 1)
    b = bucket_size(n)
    pages = _sds(spec.kv_shape(b), spec.bits_dtype)
    pool_shape = spec.kv_shape(device_pages + 1)
    return [
        Program(
            f"device_pool.take_first[{n}p]",
            "device_pool.take_first",
            device_pool.PROGRAMS["take_first"],
            (pages,),
            dict(n=n, dtype=np.dtype(spec.jnp_dtype)),
            False,
            (pool_shape,),
            pages=n,
            moved_bytes=n * spec.page_bytes,
        ),
        Program(
            f"device_pool.pad[{n}p->{b}p]",
            "device_pool.pad",
            device_pool.PROGRAMS["pad"],
            (_sds(spec.kv_shape(n), spec.jnp_dtype),),
            dict(size=b, bits_dtype=np.dtype(spec.bits_dtype)),
            False,
            (pool_shape,),
            pages=n,
            moved_bytes=n * spec.page_bytes,
        ),
    ]


def pallas_layer_programs(spec: KVSpec, device_pages: int, platform: str) -> list[Program]:
    """The Pallas layer-wise scatter (``scatter_layer_pages``) at every bucket, in the jit a
    caller gives it (pool donated)."""
    fn = _layer_scatter_jit(platform)
    pool_shape = spec.kv_shape(device_pages + 1)
    pool = _sds(pool_shape, spec.bits_dtype)
    return [
        Program(
            f"pallas.scatter_layer_pages[{b}p]",
            "pallas.scatter_layer_pages",
            fn,
            (pool, _i32(), _i32(b), _sds(spec.kv_shape(b)[1:], spec.bits_dtype)),
            {},
            True,
            (pool_shape,),
            True,
            b,
            b * spec.page_bytes // spec.num_layers,
        )
        for b in _buckets(device_pages)
    ]


@functools.cache
def _layer_scatter_jit(platform: str) -> Callable:
    import pallas_kernels as pk  # as device_pool does: only when the kernels are asked for

    impl = {"tpu": pk.Impl.TPU, "cuda": pk.Impl.MOSAIC_GPU}[platform]
    return jax.jit(
        lambda pool, layer, ids, pages: pk.scatter_layer_pages(pool, layer, ids, pages, impl=impl),
        donate_argnums=0,
    )


# ------------------------------------------------------------------------ host pool, transfers


def _memory_shardings(platform: str) -> tuple[Any, Any]:
    """``(host, device)`` shardings of the pools on ``platform``: ``pinned_host`` / ``device``
    on accelerators (what ``memory_kind="auto"`` picks), both None on CPU (the host pool then
    lives in the device's own memory). A 1-device mesh of this machine carries the memory
    kinds into the lowering (a SingleDeviceSharding's are dropped from abstract arguments)."""
    if platform == "cpu":
        return None, None
    mesh = Mesh(np.array(jax.devices()[:1]), ("lowering",))
    return (
        NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host"),
        NamedSharding(mesh, PartitionSpec(), memory_kind="device"),
    )


def host_programs(
    spec: KVSpec, device_pages: int, host_pages: int, platform: str, layout: HostLayout
) -> tuple[list[Program], dict[str, int]]:
    """The host pool's staged write / read and the transfer engine's copies."""
    host, dev = _memory_shardings(platform)
    host_shape = (
        spec.kv_shape(host_pages)
        if layout is HostLayout.LAYER_FIRST
        else spec.page_major_shape(host_pages)
    )
    pool_shape = spec.kv_shape(device_pages + 1)
    buf, pool = _sds(host_shape, spec.bits_dtype, host), _sds(pool_shape, spec.bits_dtype, dev)
    # With both pools in one memory space (CPU) the copy works on views with the two minor axes
    # merged (page_copy): those shapes must stay raw bits too.
    shapes = tuple(
        s
        for shape in (host_shape, pool_shape)
        for s in (shape, (*shape[:-2], shape[-2] * shape[-1]))
    )
    progs: list[Program] = []
    stages = sorted(
        {
            (size, index_len(count))
            for n in range(1, min(host_pages, 64) + 1)
            for _, count, size in stage_chunks(n)
        }
    )
    write = host_pool.staged_write_fn(spec, layout, host)
    for size, plan in stages:
        staged = _sds(spec.page_major_shape(size), spec.bits_dtype, dev)
        progs.append(
            _bound_program(
                f"host_pool.write[{size}p]",
                "host_pool.write",
                write,
                (buf, staged, _i32(3, plan)),
                True,
                shapes,
                size,
                spec,
            )
        )
        read = host_pool.staged_read_fn(spec, layout, size, _placed(dev), dev)
        progs.append(
            _bound_program(
                f"host_pool.read[{size}p]",
                "host_pool.read",
                read,
                (buf, _i32(3, plan)),
                False,
                shapes,
                size,
                spec,
            )
        )
    backup, load, load_layer = transfer.transfer_fns(spec.num_layers, layout, host, dev)
    n_max = min(device_pages, host_pages)
    for plan in sorted({index_len(n) for n in range(1, n_max + 1)}):
        ids, moved = _i32(3, plan), min(plan, n_max)  # the most pages a plan this long copies
        progs += [
            _bound_program(
                f"transfer.backup[plan {plan}]",
                "transfer.backup",
                backup,
                (buf, pool, ids),
                True,
                shapes,
                moved,
                spec,
            ),
            _bound_program(
                f"transfer.load[plan {plan}]",
                "transfer.load",
                load,
                (pool, buf, ids),
                True,
                shapes,
                moved,
                spec,
            ),
            _bound_program(
                f"transfer.load_layer[plan {plan}]",
                "transfer.load_layer",
                load_layer,
                (pool, buf, ids),
                True,
                shapes,
                moved,
                spec,
                spec.num_layers,
            ),
        ]
    bounds = {
        "host_pool.write": len(STAGE_SIZES),
        "host_pool.read": len(STAGE_SIZES),
        **{f"transfer.{op}": _bound(n_max) for op in ("backup", "load", "load_layer")},
    }
    return progs, bounds


def _window_programs(
    tag: str,
    gspec: KVSpec,
    device_pages: int,
    host_pages: int,
    platform: str,
    layout: HostLayout,
) -> tuple[list[Program], dict[str, int]]:
    """Window group ``g``'s programs (its pages, ``gspec``, live in pools of their own with the
    full-attention pools' page counts: ``write_window_kv`` / ``read_window_kv`` use the device
    pool's scatter and gather, backups and loads the transfer engine's copies), named
    ``<tag><name>``: ``window{g}.`` (a ``STATE`` group's slots: ``state{g}.``, a slot its
    "page")."""
    progs, bounds = device_pool_programs(gspec, device_pages, platform, "xla")
    more, more_bounds = host_programs(gspec, device_pages, host_pages, platform, layout)
    progs += more
    bounds.update(more_bounds)
    return (
        [dataclasses.replace(p, name=tag + p.name, op=tag + p.op) for p in progs],
        {tag + op: n for op, n in bounds.items()},
    )


def _fused_programs(
    spec: KVSpec, device_pages: int, host_pages: int, platform: str, layout: HostLayout
) -> tuple[list[Program], dict[str, int]]:
    """With window groups, a backup or a (not layer-wise) load copies the full-attention pages
    and every group's in ONE program (``page_copy.fused_copy``; every group's plan as long as
    the full pages'): ``transfer.fused_backup`` / ``transfer.fused_load`` at every plan
    length."""
    host, dev = _memory_shardings(platform)
    specs = [spec, *(g.spec(spec.page_size, spec.shard) for g in spec.window_groups)]

    def host_shape(sp: KVSpec) -> tuple:
        if layout is HostLayout.LAYER_FIRST:
            return sp.kv_shape(host_pages)
        return sp.page_major_shape(host_pages)

    bufs = [_sds(host_shape(sp), sp.bits_dtype, host) for sp in specs]
    pools = [_sds(sp.kv_shape(device_pages + 1), sp.bits_dtype, dev) for sp in specs]
    shapes = tuple(
        x
        for sp in specs
        for shape in (host_shape(sp), sp.kv_shape(device_pages + 1))
        for x in (shape, (*shape[:-2], shape[-2] * shape[-1]))
    )
    fns = [transfer.transfer_fns(sp.num_layers, layout, host, dev) for sp in specs]
    backup = page_copy.fused_copy([f[0] for f in fns])
    load = page_copy.fused_copy([f[1] for f in fns])
    n_max = min(device_pages, host_pages)
    progs = []
    for plan in sorted({index_len(n) for n in range(1, n_max + 1)}):
        plans, moved = _i32(len(specs), 3, plan), min(plan, n_max)
        nbytes = moved * sum(sp.page_bytes for sp in specs)
        for op, fn, args in (
            ("fused_backup", backup, (bufs[0], tuple(bufs[1:]), pools[0], tuple(pools[1:]))),
            ("fused_load", load, (pools[0], tuple(pools[1:]), bufs[0], tuple(bufs[1:]))),
        ):
            progs.append(
                Program(
                    f"transfer.{op}[plan {plan}]",
                    f"transfer.{op}",
                    fn,
                    (*args, plans),
                    {},
                    True,
                    shapes,
                    pages=moved,
                    moved_bytes=nbytes,
                )
            )
    return progs, {f"transfer.{op}": _bound(n_max) for op in ("fused_backup", "fused_load")}


def _placed(sharding: Any) -> Any:
    """The device sharding a staged read lands in (device 0 when the pools are unsharded)."""
    return sharding if sharding is not None else jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _bound_program(
    name: str,
    op: str,
    fn: Any,
    args: tuple,
    donated: bool,
    shapes: tuple,
    pages: int,
    spec: KVSpec,
    per_layer: int = 1,
) -> Program:
    """A program from a ``functools.partial`` of a jit (its keywords are the static args)."""
    return Program(
        name,
        op,
        fn.func,
        (*fn.args, *args),
        dict(fn.keywords),
        donated,
        shapes,
        pages=pages,
        moved_bytes=pages * spec.page_bytes // per_layer,
    )


# ------------------------------------------------------------------------------ engine steps


#: the dtypes the reference decoder runs in
_MODEL_DTYPES = ("float32", "bfloat16", "float16")


def engine_model(spec: KVSpec) -> ModelConfig | None:
    """The decoder whose steps are lowered at ``spec``: Llama-3-8B when ``spec`` is its KV
    (any page size), else a small one with the spec's layers, kv heads, head_dim and dtype
    (2 query heads per kv head, d_model = heads x head_dim, vocab 512). None for a KV the
    decoder cannot hold (MLA, fp8 / int8)."""
    if spec.mla or spec.dtype not in _MODEL_DTYPES:
        return None
    if spec.window_groups:
        return _pattern_model(spec)
    kv = (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype)
    if kv == (LLAMA3_8B.num_layers, LLAMA3_8B.num_kv_heads, LLAMA3_8B.head_dim, LLAMA3_8B.dtype):
        return LLAMA3_8B
    heads = 2 * spec.num_kv_heads
    d = heads * spec.head_dim
    return ModelConfig(
        vocab_size=512,
        num_layers=spec.num_layers,
        d_model=d,
        num_heads=heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        ffn_dim=2 * d,
        dtype=spec.dtype,
    )


def _pattern_model(spec: KVSpec) -> ModelConfig | None:
    """The small decoder of a ``KVSpec.from_pattern`` spec (one window or chunk group of the
    full group's KV shape, repeating ``local:full`` runs; or one STATE group, whose model is
    the reference hybrid's when its state arrays are that model's); None for any other
    grouped spec."""
    if len(spec.window_groups) == 2 and len(spec.state_groups) == 1:  # "R2:S1:F1"
        return _three_kind_model(spec)
    (group,) = spec.window_groups if len(spec.window_groups) == 1 else (None,)
    if group is not None and group.kind is GroupKind.STATE:
        return _recurrent_model(spec, group)
    if group is None or (group.num_kv_heads, group.head_dim, group.dtype) != (
        spec.num_kv_heads,
        spec.head_dim,
        spec.dtype,
    ):
        return None
    return _small_pattern_model(spec, group, "{a}:{b}", window=group.window, chunk=group.chunk)


def _small_pattern_model(spec: KVSpec, group: Any, pattern: str, **more: Any) -> ModelConfig | None:
    """The small decoder whose ``layer_pattern`` (``pattern`` with the run lengths ``a``
    local / recurrent layers, ``b`` full ones filled in) repeats ``group``'s layers beside
    the full layers of ``spec``'s shape (``more``: the pattern's other fields); None when
    it is not a model or its KV spec is not ``spec``."""
    total = spec.total_layers
    local = set(group.layers)
    a = next((i for i in range(total) if i not in local), total)
    b = next((i for i in range(a, total) if i in local), total) - a
    heads = 2 * spec.num_kv_heads
    d = heads * spec.head_dim
    try:
        cfg = ModelConfig(
            vocab_size=512,
            num_layers=total,
            d_model=d,
            num_heads=heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            ffn_dim=2 * d,
            dtype=spec.dtype,
            layer_pattern=pattern.format(a=a, b=b),
            **more,
        )
    except (ValueError, TypeError):
        return None
    return cfg if DecoderModel(cfg, abstract_params(cfg)).kv_spec(spec.page_size) == spec else None


class _RecordingPool:
    """A device pool of shapes only: ``run`` records the step and its arguments and returns
    the step's other result as zeros of its shapes (``eval_shape``), so the model's host code
    runs as it would on a real pool."""

    def __init__(self, spec: KVSpec, num_pages: int) -> None:
        self.spec, self.num_pages = spec, num_pages
        self.array = _sds(spec.kv_shape(num_pages + 1), spec.bits_dtype)
        self.calls: list[tuple[Any, tuple]] = []

    def run(self, fn: Any, *args: Any) -> Any:
        self.calls.append((fn, args))
        return _zeros(jax.eval_shape(fn, self.array, *args)[1])

    def run_with(self, others: Any, fn: Any, *args: Any) -> Any:
        """``DevicePagePool.run_with``: the step over this pool and ``others`` (a patterned
        model's window group pools), recorded with their arrays as its second argument."""
        arrays = tuple(o.array for o in others)
        self.calls.append((fn, (arrays, *args)))
        return _zeros(jax.eval_shape(fn, self.array, arrays, *args)[2])


def _zeros(shapes: Any) -> Any:
    """Numpy zeros of a step's other results (logits, tokens, states: small), which the
    model's host code may index as it would a real step's."""
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)


def _abstract(x: Any) -> Any:
    if isinstance(x, (np.ndarray, jax.Array)):
        return _sds(x.shape, x.dtype)
    return x


def _recorded(name: str, op: str, pool: _RecordingPool) -> Program:
    fn, args = pool.calls[-1]  # (a run_with step's window pools: its first argument here)
    static = fn.args if isinstance(fn, functools.partial) else ()
    fn = fn.func if isinstance(fn, functools.partial) else fn
    return Program(
        name,
        op,
        fn,
        (*static, pool.array, *jax.tree.map(_abstract, args)),
        {},
        True,
        (pool.array.shape,),
    )


def _default(cls: type, name: str) -> Any:
    return inspect.signature(cls).parameters[name].default


def engine_programs(spec: KVSpec, device_pages: int, cfg: ModelConfig) -> list[Program]:
    """The serial engine's steps and the batched engine's packed step, recorded from the
    model's own host code with the engines' default buckets and blocks."""
    model = DecoderModel(cfg, abstract_params(cfg))
    ps = spec.page_size
    pool = _RecordingPool(spec, device_pages)
    if model.recurrent:
        return _recurrent_programs(model, pool, device_pages)
    windows = [_RecordingPool(g.spec(ps), device_pages) for g in spec.window_groups]
    chunk, pre_bucket = _default(Engine, "chunk_size"), _default(Engine, "prefill_bucket")
    prompt = min(chunk, 100)
    ctx = min(device_pages * ps - 1, 8 * prompt)
    pages = np.arange(min(device_pages, -(-(ctx + 1) // ps)), dtype=np.int32)
    toks = lambda n: np.zeros(n, np.int32)  # noqa: E731
    win: dict[str, Any] = {}
    if windows:  # a patterned model: every step over the full pool and the window pools
        win = dict(windows=windows, window_pages=np.zeros((len(windows), pages.size), np.int32))
    progs = []
    with step_records_kept():
        long = min(prompt, ctx)
        model.forward(pool, toks(long), 0, pages, min_bucket=pre_bucket, **win)
        fused = "unrolled" if windows else "scan"
        progs.append(
            _recorded(
                f"engine.prefill[{bucket(long, pre_bucket)}t,{fused}]", "engine.prefill", pool
            )
        )
        short = max(1, min(pre_bucket, ctx - long))
        model.forward(pool, toks(short), long, pages, min_bucket=pre_bucket, **win)
        progs.append(
            _recorded(
                f"engine.prefill[{bucket(short, pre_bucket)}t,unrolled]", "engine.prefill", pool
            )
        )
        model.forward(pool, toks(1), ctx, pages, **win)
        progs.append(_recorded(f"engine.decode[ctx {ctx}]", "engine.decode", pool))
        if not windows:  # (a patterned model's layer-wise steps: not listed)
            progs.append(_layer_program(model, pool, bucket(long, pre_bucket), pages))
        progs += _batched_programs(model, pool, ctx, pages, win)
    return progs


def _recurrent_programs(
    model: DecoderModel, pool: _RecordingPool, device_pages: int
) -> list[Program]:
    """A recurrent-pattern model's steps (``RECURRENT_STEP``; with local layers, ``"R2:S1:F1"``,
    ``RECURRENT_PATTERN_STEP`` over the window pools too): a prefill chunk in the chunked
    form (the full layers over the pool, the recurrent layers from the request's own state,
    the boundary states its checkpoints come from) and a decode token in the step form; and
    the batched engine's rows of each (``forward_recurrent_rows``)."""
    ps = pool.spec.page_size
    chunk, pre_bucket = _default(Engine, "chunk_size"), _default(Engine, "prefill_bucket")
    step = model.recurrent_chunk(ps)
    prompt = max(step, min(chunk, 96) // step * step)
    ctx = min(device_pages * ps - 1, 8 * prompt)
    prompt = max(step, min(prompt, ctx) // step * step)
    pages = np.arange(min(device_pages, -(-(ctx + 1) // ps)), dtype=np.int32)
    state = model.zero_state()
    groups = pool.spec.window_groups if len(pool.spec.window_groups) > 1 else ()
    windows = [_RecordingPool(g.spec(ps), device_pages) for g in groups]
    win: dict[str, Any] = {}
    if windows:  # the local layers over their window pools
        win = dict(windows=windows, window_pages=np.zeros((len(windows), pages.size), np.int32))
    progs = []
    with step_records_kept():
        model.forward_recurrent(pool, np.zeros(prompt, np.int32), 0, pages, state, **win)
        tb = bucket(prompt, pre_bucket)
        progs.append(_recorded(f"engine.recurrent_prefill[{tb}t]", "engine.prefill", pool))
        model.forward_recurrent(pool, np.zeros(1, np.int32), ctx, pages, state, **win)
        progs.append(_recorded(f"engine.recurrent_decode[ctx {ctx}]", "engine.decode", pool))
        progs += _recurrent_rows(model, pool, prompt, ctx, pages, state, win)
    return progs


def _recurrent_rows(
    model: DecoderModel,
    pool: _RecordingPool,
    prompt: int,
    ctx: int,
    pages: np.ndarray,
    state: Any,
    win: dict[str, Any],
) -> list[Program]:
    """The batched engine's two recurrent steps (``RECURRENT_ROWS`` /
    ``RECURRENT_PATTERN_ROWS``) with its default buckets: the prefill chunks of two requests
    in one step, and three decode rows in another."""
    knobs = dict(
        min_pages=_default(BatchedEngine, "table_bucket"),
        min_batch=_default(BatchedEngine, "batch_bucket"),
    )
    slots = TokenSlots(_default(BatchedEngine, "max_running"))

    def rows(n: int) -> dict[str, Any]:
        if not win:
            return {}
        return dict(windows=win["windows"], window_pages=[win["window_pages"]] * n)

    model.forward_recurrent_rows(
        pool,
        [np.zeros(prompt, np.int32)] * 2,
        [0, 0],
        [pages, pages[::-1].copy()],
        [state] * 2,
        slots,
        [0, 1],
        min_bucket=_default(BatchedEngine, "query_block"),
        **knobs,
        **rows(2),
    )
    prefill = _recorded(f"batched.recurrent_rows[2 x {prompt}t]", "batched.step", pool)
    model.forward_recurrent_rows(
        pool, None, [ctx] * 3, [pages] * 3, [state] * 3, slots, [0, 1, 2], **knobs, **rows(3)
    )
    return [prefill, _recorded("batched.recurrent_rows[3 decode]", "batched.step", pool)]


def _layer_program(
    model: DecoderModel, pool: _RecordingPool, tb: int, pages: np.ndarray
) -> Program:
    """The per-layer step of a layer-wise load-back (``LAYER``) with the arguments
    ``forward(waiter=...)`` gives it: the embedding runs eagerly there, so it cannot be
    recorded on shapes; the arguments are built the same way."""
    cfg = model.cfg
    table = _i32(bucket(pages.shape[0]))
    x = _sds((tb, cfg.d_model), cfg.dtype)
    layer = {k: _sds(v.shape[1:], v.dtype) for k, v in model.params["layers"].items()}
    return Program(
        f"engine.layer[{tb}t]",
        "engine.layer",
        LAYER,
        (cfg, pool.array, _i32(), layer, x, _i32(), _i32(), table),
        {},
        True,
        (pool.array.shape,),
    )


def _batched_programs(
    model: DecoderModel,
    pool: _RecordingPool,
    ctx: int,
    pages: np.ndarray,
    win: dict[str, Any] | None = None,
) -> list[Program]:
    knobs = {k: _default(BatchedEngine, k) for k in ("query_block", "key_block")}
    knobs.update(
        min_pages=_default(BatchedEngine, "table_bucket"),
        min_batch=_default(BatchedEngine, "batch_bucket"),
    )
    slots = TokenSlots(_default(BatchedEngine, "max_running"))
    n = pages.shape[0]
    lists = [pages, pages[::-1].copy(), np.roll(pages, n // 2), np.roll(pages, n // 3)]
    starts = [0, ctx // 2, ctx // 3, ctx - 1]
    prefill = min(_default(BatchedEngine, "token_budget"), max(2, ctx // 2))
    chunks = [np.zeros(prefill, np.int32)] + [np.zeros(1, np.int32)] * 3

    def windows_of(tables: list[np.ndarray]) -> dict[str, Any]:
        if not win:
            return {}
        g = len(win["windows"])
        return dict(
            windows=win["windows"], window_pages=[np.zeros((g, t.size), np.int32) for t in tables]
        )

    model.forward_batch(
        pool,
        chunks,
        starts,
        lists,
        slots=slots,
        slot_of=[0, 1, 2, 3],
        from_slot=[False, True, True, True],
        **knobs,
        **windows_of(lists),
    )
    mixed = _recorded(f"batched.step[{prefill}t + 3 decode]", "batched.step", pool)
    model.forward_batch(
        pool,
        chunks[1:],
        starts[1:],
        lists[1:],
        slots=slots,
        slot_of=[1, 2, 3],
        from_slot=[True] * 3,
        **knobs,
        **windows_of(lists[1:]),
    )
    return [mixed, _recorded("batched.step[3 decode]", "batched.step", pool)]


# ------------------------------------------------------------------------------------ all


def programs(
    spec: KVSpec,
    platform: str,
    *,
    device_pages: int,
    host_pages: int | None = None,
    host_layout: HostLayout | str = HostLayout.LAYER_FIRST,
    engine: bool = True,
) -> ProgramSet:
    """Every device program of a cache of ``spec`` with ``device_pages`` L1 pages and
    ``host_pages`` L2 pages (default 4x) on ``platform``, and the engines' steps.

    Raises:
        TypeError / ValueError: a bad spec, platform or size (named).
    """
    if not isinstance(spec, KVSpec):
        raise TypeError(f"spec must be a KVSpec, got {type(spec).__name__}")
    if platform not in PLATFORMS:
        raise ValueError(f"platform={platform!r} must be one of {PLATFORMS}")
    for name, value in (("device_pages", device_pages), ("host_pages", host_pages)):
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    host_pages = 4 * device_pages if host_pages is None else host_pages
    layout = HostLayout(host_layout)
    progs, bounds = device_pool_programs(spec, device_pages, platform, "xla")
    notes = []
    if platform in ("tpu", "cuda"):
        more, more_bounds = device_pool_programs(spec, device_pages, platform, "pallas")
        progs += more + pallas_layer_programs(spec, device_pages, platform)
        bounds.update(more_bounds, **{"pallas.scatter_layer_pages": _bound(device_pages)})
    else:
        notes.append("Pallas kernels: none compiled for cpu (the pool runs them interpreted)")
    if platform == "cuda":
        notes.append(
            "Mosaic GPU kernels: grid of this machine's default block count (a GPU "
            "process uses one block per SM), the kernel body is the same"
        )
    notes.append("pools unsharded (one device): the head-sharded mesh variants are not listed")
    progs += pool_helper_programs(spec, device_pages)
    more, more_bounds = host_programs(spec, device_pages, host_pages, platform, layout)
    progs += more
    bounds.update(more_bounds)
    for g, group in enumerate(spec.window_groups):  # each window group's pools and copies
        tag = f"state{g}." if group.kind is GroupKind.STATE else f"window{g}."
        more, more_bounds = _window_programs(
            tag, group.spec(spec.page_size, spec.shard), device_pages, host_pages, platform, layout
        )
        progs += more
        bounds.update(more_bounds)
    if spec.window_groups:
        more, more_bounds = _fused_programs(spec, device_pages, host_pages, platform, layout)
        progs += more
        bounds.update(more_bounds)
    cfg = engine_model(spec) if engine else None
    if spec.window_groups and cfg is not None:
        notes.append(
            "engine steps of a patterned model: the layer-wise (per layer) ones not listed"
        )
    if cfg is not None:
        progs += engine_programs(spec, device_pages, cfg)
    elif engine and spec.state_groups and not spec.mla and spec.dtype in _MODEL_DTYPES:
        notes.append(
            "engine steps: the reference hybrid's recurrent layers keep a conv array "
            "[conv_width - 1, d_model] and an ssm array [heads, key_dim, value_dim]; this "
            "spec's state is not theirs (e.g. --state conv:3x2048,ssm:h16x128x128 for 8 kv "
            "heads of 128)"
        )
    elif engine:
        notes.append(
            f"engine steps: the decoder cannot hold this KV ({spec.dtype}, mla={spec.mla})"
        )
    return ProgramSet(
        spec, platform, device_pages, host_pages, tuple(progs), bounds, cfg, tuple(notes)
    )


def _three_kind_model(spec: KVSpec) -> ModelConfig | None:
    """The reference hybrid of a spec with a local group beside a STATE group (``"R2:S1:F1"``):
    the pattern read off the layers' kinds (one run of each kind a period, in layer order),
    the recurrent dims as :func:`_recurrent_model` reads them; None for any other layout."""
    (s,) = spec.state_groups
    state, local = spec.window_groups[s], spec.window_groups[1 - s]
    if local.kind is GroupKind.STATE:
        return None
    letter = dict.fromkeys(range(spec.total_layers), "F")
    letter.update(dict.fromkeys(state.layers, "R") | dict.fromkeys(local.layers, "S"))
    kinds = "".join(letter[i] for i in range(spec.total_layers))
    runs = [(m.group(0)[0], len(m.group(0))) for m in re.finditer(r"R+|S+|F+", kinds)]
    if len(runs) < 3 or len({k for k, _ in runs[:3]}) != 3:
        return None
    pattern = ":".join(f"{k}{n}" for k, n in runs[:3])
    return _recurrent_model(spec, state, pattern, window=local.window, chunk=local.chunk)


def _recurrent_model(
    spec: KVSpec, group: Any, pattern: str = "R{a}:F{b}", **local: Any
) -> ModelConfig | None:
    """The reference hybrid (``pattern``: ``R{a}:F{b}``, or a three-kind one with its
    ``local`` window / chunk) of a spec with a STATE group: the full layers' shape from the
    spec, the recurrent layers' dims read from its ``conv`` / ``ssm`` arrays; None when its
    state is not that model's."""
    arrays = {a.name: a for a in group.state}
    conv, ssm = arrays.get("conv"), arrays.get("ssm")
    if conv is None or ssm is None or len(arrays) != 2 or len(ssm.shape) != 3:
        return None
    h, dk, dv = ssm.shape
    return _small_pattern_model(
        spec,
        group,
        pattern,
        **local,
        recurrent_heads=h,
        recurrent_key_dim=dk,
        recurrent_value_dim=dv,
        conv_width=conv.shape[0] + 1,
    )
