"""Launch N local ``jax.distributed`` processes for a test (no tests here).

:func:`launch` runs ``tests/multiproc_workers.py SCENARIO`` in N processes, each with one CPU
device and gloo collectives, on a coordinator port it picked free, and returns each process's
exit code, its ``RESULT`` JSON (the last line a worker prints with :func:`report`) and its
output. Every process runs in its own session (process group), and whatever is still alive at
the deadline or when the test fails is killed (``SIGKILL`` to its group) in a ``finally``, so no
straggler outlives the test.

Import it as ``from multiproc import launch``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

WORKERS = pathlib.Path(__file__).with_name("multiproc_workers.py")
ROOT = WORKERS.parent.parent


@dataclasses.dataclass
class Outcome:
    """One process's end: exit code (None: killed at the deadline), RESULT, output."""

    rc: int | None
    result: dict | None
    out: str
    after_kill: float | None = None

    def __repr__(self) -> str:
        return f"Outcome(rc={self.rc}, result={self.result}, out=...{self.out[-2000:]!r})"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the coordinator binds it right after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario: str, n: int, *args: str, timeout: float = 60.0,
           kill: dict[int, str] | None = None) -> list[Outcome]:
    """Run ``scenario`` in ``n`` processes; their outcomes, in process order.

    Args:
        args: extra command-line arguments of every worker.
        timeout: seconds for all of them; those still running then are killed (rc None).
        kill: ``{process_id: text}``: SIGKILL that process once its output shows ``text``
            (the test's "mid-run" mark); the time from then to each end is in
            ``Outcome.after_kill``.
    """
    port, kill = free_port(), dict(kill or {})
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
               PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    procs, logs = [], []
    t0, killed_at = time.monotonic(), None
    ends: dict[int, float] = {}
    try:
        for i in range(n):
            log = tempfile.TemporaryFile("w+")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKERS), scenario, str(i), str(n), str(port), *args],
                env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))
        while time.monotonic() - t0 < timeout and any(p.poll() is None for p in procs):
            for i, text in list(kill.items()):
                logs[i].seek(0)
                if text in logs[i].read():
                    _kill(procs[i])
                    del kill[i]
                    killed_at = time.monotonic()
            for i, p in enumerate(procs):
                if i not in ends and p.poll() is not None:
                    ends[i] = time.monotonic()
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill(p)
    out = [_outcome(p, log) for p, log in zip(procs, logs)]
    if killed_at is not None:
        for i, o in enumerate(out):
            o.after_kill = ends.get(i, time.monotonic()) - killed_at
    return out


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)  # its own session: the process and its children
    except ProcessLookupError:
        pass
    p.wait()


def _outcome(p: subprocess.Popen, log) -> Outcome:
    log.seek(0)
    out = log.read()
    log.close()
    rc = p.returncode
    result = None
    for line in out.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
    return Outcome(None if rc == -signal.SIGKILL else rc, result, out)
