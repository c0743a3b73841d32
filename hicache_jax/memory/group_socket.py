"""The socket transport of a process group: direct TCP connections between the processes
(ARCHITECTURE.md, "Several processes").

:class:`SocketLinks` is what :class:`hicache_jax.memory.group.DistributedGroup` uses with
``transport="socket"``: at construction every process listens on ``host`` (port ``port``; 0: an
ephemeral one), publishes ``host:port`` once through the key-value store, connects to every
lower-numbered process and accepts every higher-numbered one (one persistent connection a pair,
``TCP_NODELAY``), then closes its listener. An agreement step sends this process's frame to
every peer and reads theirs: a frame is ``<4-byte length>step\\x1etag\\x1evalue`` (UTF-8). One
one-way trip per step instead of the store's round trips through the coordinator.

The guarantees are the key-value transport's: every wait has the group's deadline (a peer that
sends nothing within ``timeout_s`` is named by :class:`GroupTimeoutError`; one whose connection
closed, a killed process, is named at once), peers are read in process order and a different
tag at the same step is :class:`GroupDivergedError`. An address that cannot be listened on or
connected to is :class:`GroupConnectError`, naming the process whose address failed.

Threading: the group's (the cache's) thread only. Standard library only (``socket``,
``selectors``).
"""

from __future__ import annotations

import selectors
import socket
import struct
import time
from typing import Any, cast

from hicache_jax.errors import GroupConnectError, GroupDivergedError, GroupTimeoutError

__all__ = ["SocketLinks", "route_host"]

_LEN = struct.Struct("!I")


def call_diverged(
    step: int, me: int, tag: str, p: int, peer_tag: str, note: str = ""
) -> GroupDivergedError:
    """The error of both transports when process ``p`` made another call (``peer_tag``) at
    agreement ``step`` than this process ``me`` (``tag``); ``note`` is appended."""
    return GroupDivergedError(
        f"processes made different calls: at agreement step {step} process {me} is at "
        f"{tag!r}, process {p} at {peer_tag!r}{note}",
        field="call",
    )


def route_host(coordinator: str | None) -> str:
    """The address of this host's interface that routes to ``coordinator`` (``host:port``;
    a UDP socket's ``connect`` picks it, no packet is sent); 127.0.0.1 when unknown."""
    if not coordinator:
        return "127.0.0.1"
    host = coordinator.rsplit(":", 1)[0].strip("[]")
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as s:
            s.connect(address)
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _frame(text: str) -> bytes:
    data = text.encode()
    return _LEN.pack(len(data)) + data


class SocketLinks:
    """Persistent TCP connections from this process to every other of the group.

    Args:
        client: the key-value store (``key_value_set``, ``blocking_key_value_get``), used once
            to publish and read the addresses.
        ns: the group's key namespace (the same on every process).
        process_id, num_processes: this process and the group's size.
        host: the address to listen on and publish (peers must be able to reach it).
        port: the port to listen on; 0 (default): an ephemeral one.
        timeout_s: the deadline of the construction and of every step.
    """

    def __init__(
        self,
        client: Any,
        ns: str,
        process_id: int,
        num_processes: int,
        *,
        host: str,
        port: int = 0,
        timeout_s: float,
    ) -> None:
        self._me, self._n, self._timeout = process_id, num_processes, timeout_s
        self._socks: dict[int, socket.socket] = {}
        self._buf: dict[int, bytearray] = {}
        self._out: dict[int, memoryview] = {}
        self._closed: dict[int, str] = {}  # peer -> why its connection ended
        self._writing: set[int] = set()  # peers whose frame waits for room to be sent
        self._sel = selectors.DefaultSelector()
        end = time.monotonic() + timeout_s
        try:
            listener = socket.create_server(
                (host, port),
                backlog=max(1, num_processes),
                family=socket.AF_INET6 if ":" in host else socket.AF_INET,
            )
        except OSError as e:
            raise GroupConnectError(
                f"process {process_id} of {num_processes} cannot listen on {host}:{port} ({e}): "
                "give DistributedGroup(host=...) an address of this host",
                process=process_id,
            ) from None
        try:
            address = f"{host}:{listener.getsockname()[1]:d}"
            client.key_value_set(f"{ns}/link/{process_id}", address)
            for p in range(process_id):
                self._connect(client, ns, p, end)
            for _ in range(process_id + 1, num_processes):
                self._accept(listener, ns, end)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        for p, s in self._socks.items():
            s.setblocking(False)
            self._buf.setdefault(p, bytearray())
            self._sel.register(s, selectors.EVENT_READ, p)

    # -- construction ---------------------------------------------------------------------

    def _connect(self, client: Any, ns: str, p: int, end: float) -> None:
        ms = max(1, int((end - time.monotonic()) * 1000))
        try:
            address = client.blocking_key_value_get(f"{ns}/link/{p}", ms)
        except Exception as e:  # jax's runtime error type varies with its version
            raise self._missing(p, "publish its address", type(e).__name__) from None
        host, _, port = address.rpartition(":")
        try:
            s = socket.create_connection((host, int(port)), timeout=self._left(end))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(self._left(end))
            s.sendall(_frame(f"hello\x1e{ns}\x1e{self._me}"))
        except OSError as e:
            raise GroupConnectError(
                f"process {self._me} of {self._n} cannot connect to process {p} at {address} "
                f"({e}): that process listens on an address this host cannot reach (give "
                "DistributedGroup(host=..., port=...) an address and open port the other hosts "
                "can reach, or transport='kv')",
                process=p,
            ) from None
        self._socks[p] = s

    def _accept(self, listener: socket.socket, ns: str, end: float) -> None:
        def first_missing() -> int:
            return next(q for q in range(self._me + 1, self._n) if q not in self._socks)

        try:
            listener.settimeout(self._left(end))
            s, _ = listener.accept()
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(self._left(end))
            hello, rest = self._read_blocking(s)
        except (OSError, ValueError) as e:
            raise self._missing(first_missing(), "connect", type(e).__name__) from None
        kind, peer_ns, peer = hello.split("\x1e")
        if kind != "hello" or peer_ns != ns:
            s.close()
            raise GroupDivergedError(
                f"process {self._me} was reached by group {peer_ns!r} of process {peer}, "
                f"not {ns!r}: the processes built their groups in different orders",
                field="group",
            )
        self._socks[int(peer)] = s
        self._buf[int(peer)] = bytearray(rest)  # the peer's first step may follow its hello

    @staticmethod
    def _read_blocking(s: socket.socket) -> tuple[str, bytes]:
        """One frame, and the bytes read after it."""
        data = b""
        while len(data) < _LEN.size or len(data) < _LEN.size + _LEN.unpack_from(data)[0]:
            chunk = s.recv(65536)
            if not chunk:
                raise ValueError("connection closed")
            data += chunk
        end = _LEN.size + _LEN.unpack_from(data)[0]
        return data[_LEN.size : end].decode(), data[end:]

    def _left(self, end: float) -> float:
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline")
        return left

    def _missing(self, p: int, what: str, why: str, step: str = "") -> GroupTimeoutError:
        return GroupTimeoutError(
            f"process {p} of {self._n} did not {what}{step} within {self._timeout:g} s: it "
            f"died, hangs, or stopped calling the cache (process {self._me} waited; {why})",
            process=p,
        )

    # -- steps ----------------------------------------------------------------------------

    def exchange(self, step: int, tag: str, value: str) -> list[str]:
        """Every process's ``value`` of this step, in process order (this one's is ``value``):
        sent to every peer, theirs read in process order, each within the deadline."""
        end = time.monotonic() + self._timeout
        frame = memoryview(_frame(f"{step}\x1e{tag}\x1e{value}"))
        for p in self._socks:
            if p not in self._closed:
                self._out[p] = frame
                self._send(p)
        rows = []
        for p in range(self._n):
            if p == self._me:
                rows.append(value)
                continue
            while (got := self._pop(p)) is None:
                if p in self._closed:
                    raise self._missing(
                        p, "reach agreement", self._closed[p], f" step {step} ({tag!r})"
                    )
                self._wait(end, p, step, tag)
            peer_step, peer_tag, peer_value = got.split("\x1e", 2)
            if peer_tag != tag or peer_step != str(step):
                raise call_diverged(
                    step,
                    self._me,
                    tag,
                    p,
                    peer_tag,
                    "" if peer_step == str(step) else f" (its step {peer_step})",
                )
            rows.append(peer_value)
        while any(len(v) for v in self._out.values()):  # our frame still going out
            self._wait(end, next(p for p, v in self._out.items() if len(v)), step, tag)
        return rows

    def _pop(self, p: int) -> str | None:
        buf = self._buf[p]
        if len(buf) < _LEN.size:
            return None
        size = _LEN.unpack_from(buf)[0]
        if len(buf) < _LEN.size + size:
            return None
        text = bytes(buf[_LEN.size : _LEN.size + size]).decode()
        del buf[: _LEN.size + size]
        return text

    def _wait(self, end: float, p: int, step: int, tag: str) -> None:
        """One round of the selector (reads into the buffers, sends what is pending), or
        :class:`GroupTimeoutError` naming ``p`` past the deadline."""
        left = end - time.monotonic()
        if left <= 0:
            raise self._missing(p, "reach agreement", "no frame", f" step {step} ({tag!r})")
        for key, events in self._sel.select(left):
            q = key.data
            if events & selectors.EVENT_READ:
                try:
                    chunk = cast(socket.socket, key.fileobj).recv(65536)  # registered: sockets
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as e:
                    chunk, why = b"", f"its connection failed: {e}"
                else:
                    why = "its connection closed"
                if chunk:
                    self._buf[q] += chunk
                else:
                    self._drop(q, why)
            if events & selectors.EVENT_WRITE and q not in self._closed:
                self._send(q)

    def _send(self, p: int) -> None:
        out = self._out[p]
        try:
            sent = self._socks[p].send(out)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as e:
            self._drop(p, f"its connection failed: {e}")
            return
        self._out[p] = rest = out[sent:]
        if bool(len(rest)) != (p in self._writing):  # wait for room to write, or no longer
            self._writing ^= {p}
            self._sel.modify(
                self._socks[p],
                selectors.EVENT_READ | (selectors.EVENT_WRITE if len(rest) else 0),
                p,
            )

    def _drop(self, p: int, why: str) -> None:
        """The peer's connection ended: what it sent before stays readable."""
        if p not in self._closed:
            self._closed[p] = why
            self._out[p] = memoryview(b"")
            self._writing.discard(p)
            self._sel.unregister(self._socks[p])

    def close(self) -> None:
        """Close every connection (the peers see them closed)."""
        self._sel.close()
        for s in self._socks.values():
            s.close()
        self._socks.clear()
