"""Processes of a ``jax.distributed`` run: joining one, and launching N on this machine.

A process joins with :func:`join` (``jax.distributed.initialize`` on the coordinator's address,
gloo collectives for CPU devices): on real hosts each host runs its own copy of the command
(``hicache-jax bench --coordinator ADDR --process-id I --num-processes N``). On one machine,
:func:`spawn` starts N copies of a command line, each told its process id, with one CPU device
each (``XLA_FLAGS=--xla_force_host_platform_device_count=1``) and a coordinator port picked free
(:func:`free_port`); every child runs in its own session (process group), so :func:`kill`
(``SIGKILL`` to the group) leaves no straggler behind, and :func:`wait_all` kills the rest as
soon as one fails (its peers would otherwise wait for it until their timeouts). The test suite
launches its multi-process tests with the same functions (``tests/multiproc.py``).

Threading: the functions here are called from one thread; children are plain subprocesses.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import IO

__all__ = ["free_port", "join", "kill", "local_env", "spawn", "wait_all"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the coordinator binds it right after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(coordinator: str, num_processes: int, process_id: int, *, timeout_s: int = 120) -> None:
    """Join the ``jax.distributed`` run of ``num_processes`` processes as ``process_id``.

    Call before anything touches a jax backend. CPU devices get gloo collectives (a sharded
    step's all-reduce over processes needs them; accelerators use their own).

    Raises:
        ValueError: a malformed address or ids (before jax is touched).
    """
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--coordinator {coordinator!r} must be HOST:PORT")
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(
            f"--process-id {process_id} must be in [0, --num-processes {num_processes})"
        )
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=timeout_s,
    )


def local_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a local child: ``base`` (default ``os.environ``) with one CPU device
    (any other ``XLA_FLAGS`` kept) and the CPU platform."""
    env = dict(os.environ if base is None else base)
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=1"])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def spawn(
    argv_of: Callable[[int], Sequence[str]],
    n: int,
    *,
    env: dict[str, str],
    cwd: str | None = None,
    stdout_of: Callable[[int], IO | int | None] = lambda i: None,
) -> list[subprocess.Popen]:
    """Start ``n`` processes, process ``i`` running ``argv_of(i)``, each in its own session,
    its output (stdout and stderr) to ``stdout_of(i)`` (None: inherited). If one cannot be
    started, those already running are killed."""
    procs: list[subprocess.Popen] = []
    try:
        for i in range(n):
            out = stdout_of(i)
            procs.append(
                subprocess.Popen(
                    list(argv_of(i)),
                    env=env,
                    cwd=cwd,
                    stdout=out,
                    stderr=None if out is None else subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    except BaseException:
        for p in procs:
            kill(p)
        raise
    return procs


def kill(p: subprocess.Popen) -> None:
    """SIGKILL ``p``'s process group (its own session: the process and its children); waits."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def wait_all(
    procs: Sequence[subprocess.Popen],
    *,
    timeout_s: float | None = None,
    grace_s: float | None = 5.0,
    poll: Callable[[], None] = lambda: None,
) -> list[int | None]:
    """Wait for every process; their exit codes (None: killed here).

    A process that exits with an error leaves its peers ``grace_s`` seconds to end (they
    raise their own errors, naming it), then the rest are killed (None: they are left to end
    or time out, e.g. a test of what peers do about a dead process); so is everything still
    running after ``timeout_s``. ``poll`` runs about every 50 ms (e.g. a test's kill trigger).
    Whatever happens, nothing started is left running.
    """
    t0, failed_at = time.monotonic(), None
    killed: set[int] = set()
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now
            if (timeout_s is not None and now - t0 > timeout_s) or (
                failed_at is not None and grace_s is not None and now - failed_at > grace_s
            ):
                break
            poll()
            time.sleep(0.05)
    finally:
        for i, p in enumerate(procs):
            if p.poll() is None:
                kill(p)
                killed.add(i)
    return [None if i in killed else p.returncode for i, p in enumerate(procs)]
