"""``hicache-jax bench`` over several processes: the model tensor-parallel over every device of a
``jax.distributed`` run, one cache copy per process (ARCHITECTURE.md, "Several processes").

Three ways in, one code path:

* ``--processes N`` (N > 1): this process runs no workload; it launches N local copies of the
  same command (:mod:`hicache_jax.cli.launch`: one CPU device each, gloo collectives, a free
  coordinator port) that join as processes ``0 .. N-1``, prints process 0's output, and exits
  with the first failing exit code (a failed process's peers are killed after a grace period;
  its output is shown).
* ``--coordinator ADDR --process-id I --num-processes N``: this process joins a run (on real
  hosts, each host runs the command with its own id); what ``--processes`` starts.
* ``--tensor-parallel``: one process over all its devices (e.g.
  ``XLA_FLAGS=--xla_force_host_platform_device_count=2``): the same sharded programs within
  one process, the reference a multi-process run is compared with (the batched engine too;
  over several processes the serial engine only).

In each, the weights are placed tensor-parallel over a mesh of ``jax.devices()`` (every
process's devices; ``shard_params``) and every cache's pools are sharded over the same mesh's
kv heads. Every process runs the same workload and makes the same calls; process 0 prints the
table and writes ``--json``, the others print nothing. At the end every process's generated
tokens and figures (all but the timings) are compared across processes (one agreement):
a difference is reported and fails the command.

Threading: everything here runs on the command's thread.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Iterator
from typing import IO, Any

from hicache_jax.cli import launch

__all__ = [
    "add_flags",
    "check_divisible",
    "check_flags",
    "joined",
    "launch_local",
    "same_on_every_process",
    "timing_free",
]

#: summary keys that are wall-clock timings (they differ between processes and runs)
TIMINGS = ("ttft_p50_ms", "ttft_p90_ms", "tokens_per_s", "wall_s")


def add_flags(parser: argparse.ArgumentParser) -> None:
    p = parser.add_argument_group("processes (ARCHITECTURE.md, 'Several processes')")
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="launch this many local processes (one CPU device each, gloo), the "
        "model tensor-parallel over them; process 0 prints the table",
    )
    p.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="join a jax.distributed run (real hosts: every host runs the command "
        "with its --process-id); the model is tensor-parallel over every "
        "process's devices",
    )
    p.add_argument("--process-id", type=int, help="with --coordinator: this process's id")
    p.add_argument("--num-processes", type=int, help="with --coordinator: processes in the run")
    p.add_argument(
        "--tensor-parallel",
        action="store_true",
        help="one process: the model tensor-parallel over all its devices (the "
        "reference of a multi-process run)",
    )


def check_flags(args: argparse.Namespace) -> None:
    """ValueError naming a bad combination of the process flags (before anything runs)."""
    if args.processes < 1:
        raise ValueError(f"--processes {args.processes} must be >= 1")
    joining = (args.coordinator, args.process_id, args.num_processes)
    if any(x is not None for x in joining) and any(x is None for x in joining):
        raise ValueError("--coordinator, --process-id and --num-processes go together")
    if args.coordinator is not None and args.processes > 1:
        raise ValueError(
            "--processes launches local processes; --coordinator joins a run: give one of them"
        )
    if args.coordinator is not None and not 0 <= args.process_id < args.num_processes:
        raise ValueError(
            f"--process-id {args.process_id} must be in [0, --num-processes {args.num_processes})"
        )
    if (args.coordinator is not None or args.processes > 1) and args.engine == "batched":
        # (its scheduler is not yet shown to decide alike on every process; --tensor-parallel
        # runs it sharded in one process)
        raise ValueError("several processes run the serial engine only (--engine serial)")


def check_divisible(args: argparse.Namespace, cfg: Any) -> None:
    """ValueError unless the processes launched or joined divide the heads, kv heads and FFN
    width (one device each; ``--tensor-parallel`` is checked once the devices are known)."""
    n = args.processes if args.processes > 1 else args.num_processes or 1
    for flag, value in (
        ("--heads", cfg.num_heads),
        ("--kv-heads", cfg.num_kv_heads),
        ("--ffn-dim", cfg.ffn_dim),
    ):
        if value % n:
            raise ValueError(
                f"{flag} {value} is not divisible by the {n} processes (the model "
                "is tensor-parallel over them)"
            )


def sharded(args: argparse.Namespace) -> bool:
    """Does this process run the model tensor-parallel?"""
    return args.coordinator is not None or args.tensor_parallel


def launch_local(args: argparse.Namespace) -> int:
    """``--processes N``: N local processes running this command as ``--coordinator``
    processes; the first failing exit code (0 when all succeed)."""
    n, port = args.processes, launch.free_port()
    argv = [
        sys.executable,
        "-m",
        "hicache_jax",
        *args.argv,
        "--processes",
        "1",
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        str(n),
    ]
    env = launch.local_env()
    # the package as this process imported it (a source checkout without an install too)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    with contextlib.ExitStack() as files:
        logs: list[IO[str] | None] = [None] + [
            files.enter_context(tempfile.TemporaryFile("w+")) for _ in range(n - 1)
        ]
        procs = launch.spawn(
            lambda i: argv + ["--process-id", str(i)], n, env=env, stdout_of=lambda i: logs[i]
        )
        codes = launch.wait_all(procs)
        bad = [(i, c) for i, c in enumerate(codes) if c != 0]
        for i, c in bad:
            log = logs[i]
            if log is not None:
                log.seek(0)
                tail = log.read()[-4000:]
                print(
                    f"--- process {i} of {n} ended with {'a kill' if c is None else c}:\n{tail}",
                    file=sys.stderr,
                    flush=True,
                )
    if bad:
        return 1 if bad[0][1] is None else bad[0][1]
    return 0


@contextlib.contextmanager
def joined(args: argparse.Namespace) -> Iterator[Any]:
    """Join the run (``--coordinator``), yield the model's mesh (None without tensor
    parallelism); on a process other than 0, stdout goes nowhere and the progress bars, the
    JSON and the plot are off. Leaves the run on exit; a process whose bench raises (or exits)
    prints the error and ends at once with its exit code (1 for an exception), without the
    shutdown's barrier."""
    if args.coordinator is not None:
        launch.join(args.coordinator, args.num_processes, args.process_id)
    import jax
    import numpy as np
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()), ("tp",)) if sharded(args) else None
    if args.coordinator is None:
        yield mesh
        return
    try:
        if jax.process_index() == 0:
            yield mesh
        else:
            args.quiet, args.json, args.plot = True, None, None
            with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
                yield mesh
    except BaseException as exc:
        # No shutdown: its barrier would wait for peers that may be waiting on this process.
        # Leaving at once lets them time out naming it (or the launcher kill them).
        code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
        if not isinstance(exc, SystemExit):
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    jax.distributed.shutdown()


def timing_free(summaries: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The summaries without their wall-clock figures, each repeat's (``<name>_runs``) too (what
    must match between processes)."""
    return {
        name: {k: v for k, v in s.items() if k.removesuffix("_runs") not in TIMINGS}
        for name, s in summaries.items()
    }


def same_on_every_process(
    outputs: dict[str, list], summaries: dict[str, dict[str, Any]], timeout_s: float = 120.0
) -> bool:
    """Are this process's generated tokens and (timing-free) figures every process's? One
    agreement (all processes call it); True on one process."""
    import jax

    if jax.process_count() == 1:
        return True
    from hicache_jax.memory.group import DistributedGroup

    payload = json.dumps(
        {
            "outputs": {k: [list(map(int, t)) for t in v] for k, v in outputs.items()},
            "figures": timing_free(summaries),
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(payload.encode()).hexdigest()
    group = DistributedGroup(timeout_s, name="hicache-jax-bench/outputs")
    return len(set(group.allgather("outputs", digest))) == 1
