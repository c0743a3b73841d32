"""The recorder a configuration asks for. Apart from the recorders so that neither they nor the
ZMQ publisher import back: ``zmq`` (an optional extra) is imported only when asked for."""

from __future__ import annotations

from hicache_jax.events.block_ids import VllmIds
from hicache_jax.events.recorder import NullRecorder, QueueRecorder, Recorder
from hicache_jax.spec import KVEventsConfig


def l3_wire_medium(cfg: KVEventsConfig | None, storage: str | None) -> str | None:
    """L3's wire ``medium`` (None: not announced, or events off): ``"auto"`` is ``"DISK"`` for
    ``file://``, ``"EXTERNAL"`` for any other store."""
    if storage is None or cfg is None or cfg.l3_medium is None:
        return None
    if cfg.l3_medium == "auto":
        return "DISK" if storage.startswith("file://") else "EXTERNAL"
    return cfg.l3_medium


def make_recorder(
    cfg: KVEventsConfig | None, storage: str | None = None
) -> NullRecorder | Recorder:
    """The recorder a configuration asks for (binds the ZMQ sockets for ``"zmq"``).

    Args:
        cfg: the parsed ``kv_events``.
        storage: the cache's L3 URL at construction (None: no L3 yet; with ``l3_medium`` set,
            a store attached later is announced under its own wire name).
    """
    if cfg is None:
        return NullRecorder()
    ids = None if cfg.block_hash == "tree" else VllmIds(cfg.block_hash, cfg.hash_seed)
    # L3 is announced whenever l3_medium is set: a store attached at run time is announced too
    # (its wire name comes with it: Recorder.l3_attached)
    l3 = cfg.l3_medium is not None
    rec: Recorder
    if cfg.publisher == "queue":
        rec = QueueRecorder(cfg.buffer_steps, cfg.buffer_bytes, ids, l3)
    else:
        from hicache_jax.events.zmq import ZmqRecorder

        rec = ZmqRecorder(cfg, ids, l3_wire_medium(cfg, storage), l3)
    rec.announce_groups = cfg.groups  # read by watch_groups (a spec with window groups)
    return rec
