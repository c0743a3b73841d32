"""Real Mooncake servers for tests: ``mooncake_master`` + a ``mooncake_client`` memory holder.

Both bind 127.0.0.1 on free ports, log into a temp directory, and are stopped by pid
(SIGTERM, then SIGKILL). Readiness is polled on the master's ``/get_all_segments`` HTTP endpoint,
which lists the holder's segment once it has mounted its memory.

Use ``mooncake_skip_reason()`` to skip with the reason when the package or binaries are missing,
``MooncakeServers.start(...)`` / ``.stop()`` directly, or the fixtures built by
``mooncake_fixture(scope)``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

import pytest

BINARIES = ("mooncake_master", "mooncake_client")
# The extra pins the wheel (mooncake-transfer-engine-non-cuda); its binaries and store module
# link Debian's libibverbs1.
INSTALL = 'pip install -e ".[mooncake]" (and apt-get install -y libibverbs1)'


def mooncake_dir() -> str | None:
    """The installed ``mooncake`` package directory (without importing it), or None."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(iter(spec.submodule_search_locations))


@functools.cache
def mooncake_skip_reason() -> str | None:
    """Why the Mooncake tests cannot run here (saying what to install), or None when they can."""
    pkg = mooncake_dir()
    if pkg is None:
        return f"mooncake not installed: {INSTALL}"
    for name in BINARIES:
        if not os.access(os.path.join(pkg, name), os.X_OK):
            return f"{name} binary missing from {pkg}: {INSTALL}"
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        hint = "apt-get install -y libibverbs1" if "libibverbs" in str(e) else INSTALL
        return f"mooncake.store does not import ({e}): {hint}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen | None, timeout_s: float = 5.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout_s)


@dataclass
class MooncakeServers:
    """A master and (optionally) one holder on 127.0.0.1."""

    rpc_port: int
    metrics_port: int
    logdir: str
    master: subprocess.Popen | None = None
    holder: subprocess.Popen | None = None
    _logs: list = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def url(self) -> str:
        return f"mooncake://{self.address}"

    @classmethod
    def start(
        cls,
        *,
        segment_bytes: int = 256 << 20,
        client_ttl_s: int = 2,
        lease_ttl_ms: int = 1000,
        timeout_s: float = 20.0,
    ) -> MooncakeServers:
        """Start a master and a holder mounting ``segment_bytes``; wait until it is mounted."""
        servers = cls(free_port(), free_port(), tempfile.mkdtemp(prefix="mooncake-test-"))
        try:
            servers._spawn_master(client_ttl_s, lease_ttl_ms)
            servers.start_holder(segment_bytes, timeout_s=timeout_s)
        except BaseException:
            servers.stop()
            raise
        return servers

    def _popen(self, name: str, args: list[str]) -> subprocess.Popen:
        # The server's log stays open while it runs; stop() closes it.
        log = open(os.path.join(self.logdir, f"{name}.log"), "ab")  # noqa: SIM115
        self._logs.append(log)
        return subprocess.Popen(
            [os.path.join(mooncake_dir(), name)] + args,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def _spawn_master(self, client_ttl_s: int, lease_ttl_ms: int) -> None:
        self.master = self._popen(
            "mooncake_master",
            [
                "--rpc_address=127.0.0.1",
                f"--rpc_port={self.rpc_port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
                f"--client_ttl={client_ttl_s}",
                f"--default_kv_lease_ttl={lease_ttl_ms}",
                "--rpc_thread_num=2",
                "--enable_metric_reporting=false",
            ],
        )

    def start_holder(self, segment_bytes: int = 256 << 20, timeout_s: float = 20.0) -> None:
        """(Re)start the holder process and wait until the master lists its segment."""
        _stop(self.holder)
        self.holder = self._popen(
            "mooncake_client",
            [
                f"--master_server_address={self.address}",
                "--metadata_server=P2PHANDSHAKE",
                "--host=127.0.0.1",
                f"--port={free_port()}",
                "--protocol=tcp",
                f"--global_segment_size={segment_bytes}",
                "--local_buffer_size=0",
            ],
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc in (self.master, self.holder):
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{proc.args[0]} exited with {proc.returncode}:\n" + self.log_tail()
                    )
            if self.segments():
                return
            time.sleep(0.1)
        raise RuntimeError(f"holder segment not mounted after {timeout_s} s:\n" + self.log_tail())

    def segments(self) -> list[str]:
        """Segment names the master lists (``/get_all_segments``); [] while unreachable."""
        url = f"http://127.0.0.1:{self.metrics_port}/get_all_segments"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                return [line for line in r.read().decode().splitlines() if line.strip()]
        except OSError:
            return []

    def kill_holder(self) -> None:
        """SIGKILL the holder (a backend dying mid-run)."""
        if self.holder is not None and self.holder.poll() is None:
            self.holder.kill()
            self.holder.wait(5)

    def kill_master(self) -> None:
        if self.master is not None and self.master.poll() is None:
            self.master.kill()
            self.master.wait(5)

    def log_tail(self, lines: int = 20) -> str:
        out = []
        for name in BINARIES:
            path = os.path.join(self.logdir, f"{name}.log")
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    out.append(f"--- {name}\n" + "".join(f.readlines()[-lines:]))
        return "\n".join(out)

    def stop(self) -> None:
        """Stop holder then master (by pid) and close the logs."""
        _stop(self.holder)
        _stop(self.master)
        for log in self._logs:
            log.close()
        self._logs.clear()


@contextlib.contextmanager
def running_mooncake(**kwargs):
    """Context manager: servers started, skipped with the reason if Mooncake is unavailable."""
    reason = mooncake_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    servers = MooncakeServers.start(**kwargs)
    try:
        yield servers
    finally:
        servers.stop()


def mooncake_fixture(scope: str = "session", **kwargs):
    """A pytest fixture (give it a name in the test module) yielding running ``MooncakeServers``."""

    @pytest.fixture(scope=scope)
    def _fixture():
        with running_mooncake(**kwargs) as servers:
            yield servers

    return _fixture
