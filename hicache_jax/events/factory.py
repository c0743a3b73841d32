"""The recorder a configuration asks for. Apart from the recorders so that neither they nor the
ZMQ publisher import back: ``zmq`` (an optional extra) is imported only when asked for."""

from __future__ import annotations

from hicache_jax.events.recorder import NullRecorder, QueueRecorder, Recorder
from hicache_jax.spec import KVEventsConfig


def make_recorder(cfg: KVEventsConfig | None) -> NullRecorder | Recorder:
    """The recorder a configuration asks for (binds the ZMQ sockets for ``"zmq"``)."""
    if cfg is None:
        return NullRecorder()
    if cfg.publisher == "queue":
        return QueueRecorder(cfg.buffer_steps, cfg.buffer_bytes)
    from hicache_jax.events.zmq import ZmqRecorder

    return ZmqRecorder(cfg)


