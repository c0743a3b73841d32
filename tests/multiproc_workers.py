"""The code each process of a multi-process test runs (no tests here; see multiproc.py).

``python multiproc_workers.py SCENARIO PROCESS_ID NUM_PROCESSES PORT [ARGS...]``: joins
``jax.distributed`` on ``127.0.0.1:PORT`` (one CPU device, gloo collectives), runs the scenario
and prints ``RESULT <json>`` (an error is a result too: its type and message), then leaves.
"""

from __future__ import annotations

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
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid,
                               initialization_timeout=60, heartbeat_timeout_seconds=30)
    return jax


def _error(e: BaseException) -> dict:
    return {"error": type(e).__name__, "message": str(e),
            "field": getattr(e, "field", None), "process": getattr(e, "process", None)}


# -- scenarios: each returns the JSON-able result of this process ------------------------------

def scenario_group(jax, pid: int, n: int, args: list[str]) -> dict:
    """allgather, MIN, leader, equal fields; then one process calls out of step."""
    from hicache_jax.memory.group import DistributedGroup

    g = DistributedGroup(timeout_s=20)
    out = {"gather": g.allgather("g", f"p{pid}"),
           "min": g.agree_min("m", [10 - pid, pid]).tolist(),
           "leader": g.leader("l", f"from {pid}")}
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
    _leave(pid, n)


def _leave(pid: int, n: int) -> None:
    """Exit without jax's shutdown barrier (a peer that raised or died must not hang this one);
    process 0 hosts the coordination service, so it waits (briefly) for the others' reports."""
    from jax._src import distributed

    client = distributed.global_state.client
    if pid:
        client.key_value_set(f"worker_done/{pid}", "1")
    else:
        for p in range(1, n):
            try:
                client.blocking_key_value_get(f"worker_done/{p}", 15_000)
            except Exception:  # that one died or hangs: the launcher kills it
                pass
    os._exit(0)


if __name__ == "__main__":
    main()
