"""Arrays between pipeline stages (parallel/stage_link.py), over loopback: what is sent arrives bit for bit,
and a peer that is gone is an error at once, naming the link."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from tinymlx.parallel.stage_link import StageLink, StageLinkError, StageListener


def linked_pair() -> tuple[StageLink, StageLink]:
    listener = StageListener("127.0.0.1")
    accepted: list[StageLink] = []
    thread = threading.Thread(target=lambda: accepted.append(listener.accept("stage 1 <- stage 0")))
    thread.start()
    sender = StageLink.connect(listener.address, "stage 0 -> stage 1")
    thread.join(timeout=10)
    listener.close()
    return sender, accepted[0]


def test_every_dtype_and_shape_arrives_bit_for_bit_in_order():
    sender, receiver = linked_pair()
    hidden = mx.random.normal((5, 7)).astype(mx.bfloat16)
    arrays = [hidden, mx.arange(12, dtype=mx.int32).reshape(3, 4), mx.array([True, False]),
              np.float16([1.5, -2.0]), mx.zeros((0, 3))]
    for _ in range(3):  # frames follow one another on one connection
        sender.send(arrays)
    for _ in range(3):
        got = receiver.receive(timeout_s=10)
        assert [a.dtype for a in got] == [mx.bfloat16, mx.int32, mx.bool_, mx.float16, mx.float32]
        for want, have in zip(arrays, got):
            assert have.shape == tuple(want.shape) and mx.array_equal(mx.array(want), have).item()
    assert sender.bytes_sent > 3 * (5 * 7 * 2 + 12 * 4)


def test_a_closed_peer_or_a_silent_one_is_an_error_naming_the_link():
    sender, receiver = linked_pair()
    with pytest.raises(StageLinkError, match="stage 1 <- stage 0: nothing came within the deadline"):
        receiver.receive(timeout_s=0.2)
    sender.close()
    with pytest.raises(StageLinkError, match="stage 1 <- stage 0: the peer closed the link"):
        receiver.receive(timeout_s=5)
    receiver.close()


def test_no_listener_is_an_error_within_the_timeout():
    listener = StageListener("127.0.0.1")
    address = listener.address
    listener._socket.close()  # nothing listens there any more
    with pytest.raises(StageLinkError, match=r"stage 0 -> stage 1: no connection to 127\.0\.0\.1:\d+ within 1 s"):
        StageLink.connect(address, "stage 0 -> stage 1", timeout_s=1)
