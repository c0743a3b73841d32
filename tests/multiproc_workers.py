"""The code each process of a multi-process test runs (no tests here; see multiproc.py).

``python multiproc_workers.py SCENARIO PROCESS_ID NUM_PROCESSES PORT [ARGS...]``: joins
``jax.distributed`` on ``127.0.0.1:PORT`` (one CPU device, gloo collectives), runs the scenario
and prints ``RESULT <json>`` (an error is a result too: its type and message), then leaves.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback


def report(**result) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def _join(pid: int, n: int, port: int):
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}",
        num_processes=n,
        process_id=pid,
        initialization_timeout=60,
        heartbeat_timeout_seconds=30,
    )
    return jax


def _error(e: BaseException) -> dict:
    return {
        "error": type(e).__name__,
        "message": str(e),
        "field": getattr(e, "field", None),
        "process": getattr(e, "process", None),
    }


# -- scenarios: each returns the JSON-able result of this process ------------------------------


def scenario_group(jax, pid: int, n: int, args: list[str]) -> dict:
    """allgather, MIN, leader, equal fields; then one process calls out of step."""
    from hicache_jax.memory.group import DistributedGroup

    g = DistributedGroup(timeout_s=20)
    out = {
        "gather": g.allgather("g", f"p{pid}"),
        "min": g.agree_min("m", [10 - pid, pid]).tolist(),
        "leader": g.leader("l", f"from {pid}"),
    }
    g.check_equal("same", [("a", "1"), ("b", "2")])
    try:
        g.check_equal("cfg", [("a", "1"), ("b", str(pid))])
    except Exception as e:
        out["differ"] = _error(e)
    try:
        g.allgather("left" if pid == 0 else "right", "x")
    except Exception as e:
        out["diverged"] = _error(e)
    return out


def _cache(jax, mesh: bool = True, **cfg):
    """A small cache over every process's device, kv heads sharded over them (``mesh``)."""
    import numpy as np
    from jax.sharding import Mesh

    from hicache_jax import HiCache, HiCacheConfig, KVSpec

    n = jax.process_count()
    spec = cfg.pop("spec", None) or KVSpec(
        num_layers=2,
        num_kv_heads=2 * n,
        head_dim=4,
        dtype="float16",
        page_size=cfg.pop("page_size", 4),
    )
    cfg = {
        "device_pages": 16,
        "host_pages": 24,
        "load_back_threshold": 4,
        "write_policy": "write_through",
        "agreement_check_every": 1,
        "agreement_timeout_s": 20.0,
    } | cfg
    if mesh:
        cfg["mesh"] = Mesh(np.array(jax.devices()), ("heads",))
    return HiCache(spec, HiCacheConfig(**cfg))


def _serve(cache, tokens) -> int:
    """One request through the handle (no KV bytes written): its cached tokens."""
    import numpy as np

    tokens = np.asarray(tokens)
    with cache.begin(tokens) as req:
        req.extend(tokens.size - req.cached_len)
        req.finish(tokens)
        return req.cached_len


def scenario_config(jax, pid: int, n: int, args: list[str]) -> dict:
    """For each ``field=value`` of args but the last, process 1 builds its cache with it (an
    int or a string): each construction's error; then ``scenario_order``'s result, then
    ``scenario_kill``'s (args[-1]: its timeout)."""
    out = {}
    for arg in args[:-1]:
        field, value = arg.split("=")
        try:
            _cache(jax, **({field: int(value) if value.isdigit() else value} if pid == 1 else {}))
            out[field] = {"built": True}
        except Exception as e:
            out[field] = _error(e)
    out["order"] = scenario_order(jax, pid, n, [])
    report(**out)  # what the killed process found, before it is killed
    out["kill"] = scenario_kill(jax, pid, n, args[-1:])
    return out | {"process": out["kill"].get("process")}


def scenario_order(jax, pid: int, n: int, args: list[str]) -> dict:
    """The same requests, the last two in a different order on process 1: found by the check
    after the call (``agreement_check_every=1``)."""
    import numpy as np

    cache = _cache(jax)
    a, b = np.arange(16), np.arange(100, 116)
    _serve(cache, np.arange(200, 208))
    done = 0
    try:
        for t in (a, b) if pid == 0 else (b, a):
            _serve(cache, t)
            done += 1
    except Exception as e:
        return _error(e) | {"done": done}
    return {"done": done}


def _workload(cache, seed: int, steps: int, check: bool = True, prefetch: bool = False) -> list:
    """A random workload, the same on every process: requests over shared prefixes (hits,
    load-backs), device and host evictions, flushes; the cache's state checked after each."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ps = cache.spec.page_size
    bases = [rng.integers(0, 1000, 6 * ps) for _ in range(4)]
    log = []
    for _ in range(steps):
        op = rng.choice(["serve"] * 6 + ["evict", "evict_host", "flush"])
        if op == "serve":
            base = bases[rng.integers(len(bases))][: ps * int(rng.integers(1, 7))]
            tail = rng.integers(0, 1000, ps * int(rng.integers(0, 3)))
            tokens = np.concatenate([base, tail])
            if prefetch and rng.random() < 0.5:
                h = cache.prefetch(tokens)
                log.append(("prefetch", 0 if h is None else h.pages_found))
            log.append(("serve", _serve(cache, tokens)))
        elif op == "evict":
            log.append(("evict", cache.evict(int(rng.integers(1, 6)) * ps)))
        elif op == "evict_host":
            log.append(("evict_host", cache.evict_host(int(rng.integers(1, 6)) * ps)))
        else:
            cache.flush()
            log.append(("flush", 0))
        if check:
            cache.check_agreement()
            cache.check_invariants()
    return log


def _decided(stats: dict) -> dict:
    """The counters every process must agree on (not timings, nor the completion lag's waits:
    whether a copy was still moving at its start is this process's own, nor the agreements
    made: one process alone makes none)."""
    return {
        k: v
        for k, v in sorted(stats.items())
        if "seconds" not in k
        and "cost_" not in k
        and "lag_waits" not in k
        and not k.startswith("agreement")
        and isinstance(v, (int, float))
    }


def scenario_workload(jax, pid: int, n: int, args: list[str]) -> dict:
    """``_workload`` on a cache sharded over every process (args: seed, steps; args[2]: a
    shared store's directory, then with prefetches)."""
    seed, steps = int(args[0]), int(args[1])
    store = {"storage": f"file://{args[2]}"} if len(args) > 2 else {}
    cache = _cache(jax, device_pages=12, host_pages=16, **store)
    log = _workload(cache, seed, steps, prefetch=bool(store))
    cache.flush()
    st = cache.stats()
    cache.close()
    return {
        "log": log,
        "stats": _decided(st),
        "agreements": cache._group.calls,
        "agreement_seconds": cache._group.seconds,
    }


def scenario_workload_lag(jax, pid: int, n: int, args: list[str]) -> dict:
    """``_workload`` with ``completion_lag`` (args: seed, steps, lag): copies complete by
    request count, so no agreement is made for them."""
    seed, steps, lag = map(int, args[:3])
    cache = _cache(jax, device_pages=12, host_pages=16, completion_lag=lag)
    log = _workload(cache, seed, steps)
    cache.flush()
    st = cache.stats()
    cache.close()
    return {
        "log": log,
        "stats": _decided(st),
        "waits": st["completion_lag_waits"],
        "transfer_agreements": cache._group.calls_by_tag["transfers"],
    }


def scenario_l3(jax, pid: int, n: int, args: list[str]) -> dict:
    """``_workload`` with prefetches, every process's cache on its own device (no mesh) over
    one shared ``file://`` store (args: seed, steps, the store's directory), then
    ``scenario_l3_miss`` (args[3]: its directory)."""
    seed, steps, url = int(args[0]), int(args[1]), f"file://{args[2]}"
    cache = _cache(jax, mesh=False, device_pages=12, host_pages=16, storage=url)
    log = _workload(cache, seed, steps, prefetch=True)
    cache.flush()
    st = cache.stats()
    cache.close()
    return {"log": log, "stats": _decided(st), "miss": scenario_l3_miss(jax, pid, n, args[3:])}


def scenario_l3_miss(jax, pid: int, n: int, args: list[str]) -> dict:
    """Each process over its own ``file://`` store (args: a directory); a prompt put to both,
    evicted from L1 and L2, then removed from process 1's store only: the pages one process
    cannot read are a miss on every process."""
    import pathlib

    import numpy as np

    root = pathlib.Path(args[0]) / f"p{pid}"
    cache = _cache(jax, mesh=False, device_pages=12, host_pages=16, storage=f"file://{root}")
    tokens = np.arange(32)
    _serve(cache, tokens)
    cache.flush()
    cache.evict(10_000)
    cache.evict_host(10_000)
    out = {"l3_before": cache.lookup(tokens, l3=True)["l3"]}
    if pid == 1:
        for f in sorted(root.rglob("*")):
            if f.is_file() and f.name.startswith("hcj"):  # the file store's entries
                f.unlink()
    out["files"] = sum(1 for f in root.rglob("hcj*") if f.is_file())
    out["l3_after"] = cache.lookup(tokens, l3=True)["l3"]
    h = cache.prefetch(tokens)
    out["prefetch"] = None if h is None else h.pages_found
    out["served_cached"] = _serve(cache, tokens)
    cache.check_agreement()
    cache.close()
    return out


def scenario_l3_windows(jax, pid: int, n: int, args: list[str]) -> dict:
    """Window groups with L3, every process's cache over its own ``file://`` store (args: a
    directory): two prompts put to both, evicted from L1 and L2; process 1's store loses the
    window group entry of one prompt's last page: on every process that prompt is not fetched
    (each lookup's cut back to the deepest end its store serves is agreed), the other is
    served whole."""
    import pathlib

    import numpy as np

    from hicache_jax import KVSpec
    from hicache_jax.l3.storage import page_keys
    from hicache_jax.l3.windows import window_keys

    spec = KVSpec.from_pattern(
        "1:1", num_layers=2, num_kv_heads=2, head_dim=4, dtype="float16", page_size=4, window=8
    )
    root = pathlib.Path(args[0]) / f"p{pid}"
    url = f"file://{root}"
    cache = _cache(jax, mesh=False, spec=spec, storage=url, prefetch_policy="wait_complete")
    cut, whole = np.arange(32), np.arange(100, 132)
    _serve(cache, cut), _serve(cache, whole)
    cache.flush()
    cache.evict(10_000)
    cache.evict_host(10_000)
    if pid == 1:
        name = window_keys(page_keys(spec, cut, None), 0)[-1]
        for f in root.rglob(name):
            f.unlink()
    out = {}
    for label, tokens in (("cut", cut), ("whole", whole)):
        h = cache.prefetch(tokens)
        out[label] = {
            "found": None if h is None else h.pages_found,
            "cached": _serve(cache, tokens),
        }
    cache.check_agreement()
    cache.check_invariants()
    st = cache.stats()
    out["window_hits"] = st["l3_window_prefetch_hit_pages"]
    out["window_missed"] = st["l3_window_prefetch_missed_pages"]
    cache.close()
    return out


def _kv(spec, tokens, start: int, stop: int):
    """The KV every cache stores for pages [start, stop) of ``tokens``: a function of the
    tokens, the position, layer, K/V, head and dim (so a page from the wrong place shows)."""
    import numpy as np

    L, kvf, _, ps, H, D = spec.kv_shape(1)
    t = np.asarray(tokens[start * ps : stop * ps], np.int64).reshape(1, 1, -1, ps, 1, 1)
    grid = np.indices((L, kvf, 1, 1, H, D)).reshape(6, L, kvf, 1, 1, H, D)
    val = (t * 7 + grid[0] * 131 + grid[1] * 17 + grid[4] * 1009 + grid[5] * 3) % 2039
    return val.astype(np.float16)


def _serve_kv(cache, tokens) -> dict:
    """One request writing its KV (all heads; each process's pool keeps its own): the cached
    part read back per shard against ``_kv``."""
    import numpy as np

    tokens = np.asarray(tokens)
    ps, heads = cache.spec.page_size, cache.local_heads
    with cache.begin(tokens) as req:
        have = req.cached_len // ps
        got = cache.read_kv_local(req.device_pages)
        ok = bool(np.array_equal(got, _kv(cache.spec, tokens, 0, have)[:, :, :, :, heads]))
        new = req.extend(tokens.size - req.cached_len)
        cache.write_kv(new, _kv(cache.spec, tokens, have, tokens.size // ps))
        req.finish(tokens)
    return {"cached": have * ps, "bytes_ok": ok}


def scenario_shards(jax, pid: int, n: int, args: list[str]) -> dict:
    """A pool sharded over the processes with an L3 store shared by them (args[0]): KV
    written, read back per shard after device and host eviction (from L2, then from L3)."""
    import numpy as np

    cache = _cache(jax, device_pages=16, host_pages=16, storage=f"file://{args[0]}")
    a, b = np.arange(32), np.arange(500, 532)
    out = {"heads": [cache.local_heads.start, cache.local_heads.stop], "first": _serve_kv(cache, a)}
    cache.flush()
    cache.evict(10_000)
    out["from_host"] = _serve_kv(cache, a)  # loaded back from L2
    _serve_kv(cache, b)
    cache.flush()
    cache.evict(10_000)
    cache.evict_host(10_000)
    out["l3_held"] = cache.lookup(a, l3=True)["l3"]
    h = cache.prefetch(a)
    out["prefetched"] = None if h is None else h.pages_found
    cache.flush()
    out["from_l3"] = _serve_kv(cache, a)
    cache.check_agreement()
    cache.check_invariants()
    cache.close()
    # then the random workload over the same store (args[1:]: seed, steps)
    return out | {"workload": scenario_workload(jax, pid, n, args[1:] + args[:1])}


def _ckpt(tokens, heads: int):
    """The recurrent state after ``tokens`` (a pure function of them), numpy float32:
    ``conv [1, 1, 3]`` and ``ssm [1, 1, heads, 2, 2]``."""
    import numpy as np

    rng = np.random.default_rng(np.asarray(tokens, np.int64).tolist())
    conv = rng.standard_normal((1, 1, 3)).astype(np.float32)
    return [conv, rng.standard_normal((1, 1, heads, 2, 2)).astype(np.float32)]


def scenario_state_shards(jax, pid: int, n: int, args: list[str]) -> dict:
    """A hybrid (one recurrent layer, one full) whose state slots split over heads, the heads
    sharded over the processes, an L3 store shared by them (args[0]): a checkpoint written
    from numpy on every process reads back bit-exact after a load-back from L2 and after a
    prefetch from L3 (each process holding its heads' part of the slots)."""
    import jax.experimental.multihost_utils as mhu
    import numpy as np

    from hicache_jax import KVSpec, StateArray

    heads = 2 * n
    spec = KVSpec.from_pattern(
        "R1:F1",
        num_layers=2,
        num_kv_heads=heads,
        head_dim=4,
        dtype="float16",
        page_size=4,
        state=[StateArray("conv", (3,)), StateArray("ssm", (heads, 2, 2), head_axis=0)],
    )
    cache = _cache(jax, spec=spec, device_pages=16, host_pages=16, storage=f"file://{args[0]}")
    tokens = np.arange(32)
    out: dict = {"sharded": not cache.window_pools[0].array.sharding.is_fully_replicated}

    def serve() -> dict:
        with cache.begin(tokens) as req:
            have = req.cached_len
            ok = None
            if have:
                got = cache.read_state(0, req.device_pages[-1:])
                want = _ckpt(tokens[:have], heads)
                whole = [np.asarray(mhu.process_allgather(g, tiled=True)) for g in got]
                ok = all(
                    np.array_equal(g.view(np.uint32), w.view(np.uint32))
                    for g, w in zip(whole, want, strict=True)
                )
            new = req.extend(tokens.size - have)
            if new.size:
                cache.write_state(0, new[-1:], _ckpt(tokens, heads))
            req.finish(tokens)
        return {"cached": have, "state_ok": ok}

    out["first"] = serve()
    cache.flush()
    cache.evict(10_000)
    out["from_host"] = serve()  # loaded back from L2
    cache.flush()
    cache.evict(10_000)
    cache.evict_host(10_000)
    h = cache.prefetch(tokens)
    out["prefetched"] = None if h is None else h.pages_found
    cache.flush()
    out["from_l3"] = serve()
    cache.check_agreement()
    cache.check_invariants()
    cache.close()
    return out


def scenario_kill(jax, pid: int, n: int, args: list[str]) -> dict:
    """Every process runs the workload until the launcher kills the last one; the others must
    raise within the agreement timeout (args[0] seconds), naming it."""
    import time as _time

    cache = _cache(jax, agreement_timeout_s=float(args[0]), device_pages=12, host_pages=16)
    _workload(cache, 1, 3)
    print("READY", flush=True)  # the launcher kills the last process on seeing this
    t_last = _time.monotonic()
    try:
        for i in range(100000):
            t_last = _time.monotonic()
            _workload(cache, 2 + i, 1, check=False)
    except Exception as e:
        return _error(e) | {"waited": _time.monotonic() - t_last}
    return {"finished": True}


def main() -> None:
    scenario, pid, n, port, *args = sys.argv[1:]
    pid, n = int(pid), int(n)
    jax = _join(pid, n, int(port))
    t0 = time.monotonic()
    try:
        result = globals()[f"scenario_{scenario}"](jax, pid, n, args)
    except Exception as e:  # reported, then the process leaves at once (peers may be gone)
        result = _error(e) | {"trace": traceback.format_exc()[-3000:]}
    result["seconds"] = time.monotonic() - t0
    report(**result)
    _leave(pid, n, result.get("process"))


def _leave(pid: int, n: int, missing: int | None) -> None:
    """Exit without jax's shutdown barrier (a peer that raised or died must not hang this one);
    process 0 hosts the coordination service, so it waits (briefly) for the others' reports."""
    from jax._src import distributed

    client = distributed.global_state.client
    if pid:
        client.key_value_set(f"worker_done/{pid}", "1")
    else:
        for p in set(range(1, n)) - {missing}:
            # that one died or hangs: the launcher kills it
            with contextlib.suppress(Exception):
                client.blocking_key_value_get(f"worker_done/{p}", 5_000)
    os._exit(0)


if __name__ == "__main__":
    main()
