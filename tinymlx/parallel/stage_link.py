"""Arrays between pipeline stages over TCP: a step's hidden states from one stage to the next.

Why not `mx.distributed.send`/`recv`: MLX's ring backend sends only to a rank's two neighbours and cannot
split its group, so the ranks of one stage could not keep an all-reduce of their own (tensor parallelism
inside a stage) beside the pipeline; and a peer lost in the middle of a ring collective leaves the other
waiting forever. Here each process keeps at most one MLX group, its stage's tensor-parallel ranks, and the
pipeline's transfers are plain sockets: a peer that exits closes its end, and the next read or write fails
at once, naming the link.

    frame:  [header length: u64][header: JSON [[dtype, shape], ...]][each array's bytes, in order]
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import struct
import time

import mlx.core as mx
import numpy as np

_LENGTH = struct.Struct("<Q")
# numpy has no bfloat16: such arrays travel as their 16-bit patterns.
_BITS_OF = {mx.bfloat16: mx.uint16}
_BFLOAT16 = "bfloat16"


class StageLinkError(ConnectionError):
    """A pipeline link failed: its peer closed it, or nothing came within the deadline."""


class StageLink:
    """One connected socket between two ranks; either end sends and receives whole frames."""

    def __init__(self, sock: socket.socket, name: str):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a decode step's rows are a few KB
        self._socket, self.name = sock, name
        self.bytes_sent = 0

    @classmethod
    def connect(cls, address: tuple[str, int], name: str, timeout_s: float = 30.0) -> StageLink:
        """Connect to a peer's `StageListener`, retrying until it listens or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return cls(socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic())), name)
            except OSError as error:
                if time.monotonic() >= deadline:
                    raise StageLinkError(f"{name}: no connection to {address[0]}:{address[1]} within "
                                         f"{timeout_s:.0f} s ({error})") from None
                time.sleep(0.05)

    def send(self, arrays: list[mx.array | np.ndarray]) -> None:
        """Send `arrays` (MLX's are evaluated here) as one frame."""
        header, buffers = [], []
        for array in arrays:
            dtype_name, host = _to_host(array)
            header.append([dtype_name, list(host.shape)])
            buffers.append(np.ascontiguousarray(host).reshape(-1).view(np.uint8))
        encoded = json.dumps(header).encode()
        self._write([_LENGTH.pack(len(encoded)), encoded, *buffers])

    def receive(self, timeout_s: float | None = None) -> list[mx.array]:
        """The next frame's arrays, as MLX arrays; StageLinkError if the peer closed or none came in time."""
        return [mx.array(data).view(mx.bfloat16) if dtype_name == _BFLOAT16 else mx.array(data)
                for dtype_name, data in self._frame(timeout_s)]

    def receive_host(self, timeout_s: float | None = None) -> list[np.ndarray]:
        """The next frame's arrays as numpy's (a step's host inputs; a bfloat16 array as its 16-bit patterns)."""
        return [data for _, data in self._frame(timeout_s)]

    def _frame(self, timeout_s: float | None) -> list[tuple[str, np.ndarray]]:
        self._socket.settimeout(timeout_s)
        (length,) = _LENGTH.unpack(self._read(_LENGTH.size))
        arrays = []
        for dtype_name, shape in json.loads(self._read(length)):
            dtype = np.dtype(np.uint16 if dtype_name == _BFLOAT16 else dtype_name)
            data = np.frombuffer(self._read(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize), dtype)
            arrays.append((dtype_name, data.reshape(shape)))
        return arrays

    def wait_readable(self, timeout_s: float) -> bool:
        """Whether a frame (or the peer's close) arrived within `timeout_s`; nothing is read."""
        return bool(select.select([self._socket], [], [], timeout_s)[0])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._socket.close()

    def _write(self, parts: list) -> None:
        self._socket.settimeout(None)
        try:
            for part in parts:
                self._socket.sendall(part)
                self.bytes_sent += len(part)
        except OSError as error:
            raise StageLinkError(f"{self.name}: the peer is gone ({error})") from None

    def _read(self, size: int) -> bytearray:
        data = bytearray(size)
        view, got = memoryview(data), 0
        try:
            while got < size:
                n = self._socket.recv_into(view[got:])
                if n == 0:
                    raise StageLinkError(f"{self.name}: the peer closed the link")
                got += n
        except TimeoutError:
            raise StageLinkError(f"{self.name}: nothing came within the deadline") from None
        except OSError as error:
            raise StageLinkError(f"{self.name}: the peer is gone ({error})") from None
        return data


class StageListener:
    """A rank's listening socket, which its peers (rank 0, the stage before it) connect to."""

    def __init__(self, host: str, port: int = 0):
        try:
            self._socket = socket.create_server((host, port))
        except OSError as error:
            raise StageLinkError(f"cannot listen on {host}:{port} ({error.strerror})") from None
        self.address: tuple[str, int] = self._socket.getsockname()[:2]

    def accept(self, name: str, timeout_s: float = 30.0) -> StageLink:
        self._socket.settimeout(timeout_s)
        try:
            sock, _ = self._socket.accept()
        except TimeoutError:
            raise StageLinkError(f"{name}: no peer connected to {self.address[0]}:{self.address[1]} within "
                                 f"{timeout_s:.0f} s") from None
        sock.settimeout(None)
        return StageLink(sock, name)

    def close(self) -> None:
        self._socket.close()


def _to_host(array: mx.array | np.ndarray) -> tuple[str, np.ndarray]:
    if isinstance(array, np.ndarray):
        return array.dtype.name, array
    if array.dtype in _BITS_OF:
        return _BFLOAT16, np.asarray(array.view(_BITS_OF[array.dtype]))
    host = np.asarray(array)
    return host.dtype.name, host
