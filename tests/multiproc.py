"""Launch N local ``jax.distributed`` processes for a test (no tests here).

:func:`launch` runs ``tests/multiproc_workers.py SCENARIO`` in N processes, each with one CPU
device and gloo collectives, on a coordinator port it picked free, and returns each process's
exit code, its ``RESULT`` JSON (the last line a worker prints with :func:`report`) and its
output. Every process runs in its own session (process group), and whatever is still alive at
the deadline or when the test fails is killed (``SIGKILL`` to its group) in a ``finally``, so no
straggler outlives the test.

Import it as ``from multiproc import launch``. Starting, killing and waiting are
``hicache_jax.cli.launch``'s (the same code ``hicache-jax bench --processes N`` runs).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

from hicache_jax.cli import launch as launch_mod

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


def launch(
    scenario: str, n: int, *args: str, timeout: float = 60.0, kill: dict[int, str] | None = None
) -> list[Outcome]:
    """Run ``scenario`` in ``n`` processes; their outcomes, in process order.

    Args:
        args: extra command-line arguments of every worker.
        timeout: seconds for all of them; those still running then are killed (rc None).
        kill: ``{process_id: text}``: SIGKILL that process once its output shows ``text``
            (the test's "mid-run" mark); the time from then to each end is in
            ``Outcome.after_kill``.
    """
    port, kill = launch_mod.free_port(), dict(kill or {})
    env = dict(launch_mod.local_env(), PYTHONPATH=str(ROOT))
    # Each process's output, read and closed by _outcome() once it has ended.
    logs = [tempfile.TemporaryFile("w+") for _ in range(n)]  # noqa: SIM115
    procs = launch_mod.spawn(
        lambda i: [sys.executable, str(WORKERS), scenario, str(i), str(n), str(port), *args],
        n,
        env=env,
        cwd=str(ROOT),
        stdout_of=lambda i: logs[i],
    )
    killed_at: list[float] = []
    ends: dict[int, float] = {}

    def poll() -> None:
        for i, text in list(kill.items()):
            logs[i].seek(0)
            if text in logs[i].read():
                launch_mod.kill(procs[i])
                del kill[i]
                killed_at.append(time.monotonic())
        for i, p in enumerate(procs):
            if i not in ends and p.poll() is not None:
                ends[i] = time.monotonic()

    # a killed or failed process leaves the others to raise their own errors (grace None)
    launch_mod.wait_all(procs, timeout_s=timeout, grace_s=None, poll=poll)
    out = [_outcome(p, log) for p, log in zip(procs, logs)]
    if killed_at:
        for i, o in enumerate(out):
            o.after_kill = ends.get(i, time.monotonic()) - killed_at[0]
    return out


def _outcome(p: subprocess.Popen, log) -> Outcome:
    log.seek(0)
    out = log.read()
    log.close()
    rc = p.returncode
    result = None
    for line in out.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    return Outcome(None if rc == -signal.SIGKILL else rc, result, out)
