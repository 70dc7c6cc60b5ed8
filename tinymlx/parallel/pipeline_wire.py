"""What rank 0 and a pipeline's stage workers say to each other over their links (parallel/stage_link.py).

Each worker listens on its address. Rank 0 connects a control link to every worker, and each stage but the last
connects a hidden link to the next stage's rank (the last stage is rank 0's). A link's first frame says which
it is, so a listener takes its links in whatever order they arrive.

    control frames (rank 0 -> worker):  [[command], *payload]   (step_broadcast.Command)
    replies to LOAD (worker -> rank 0): [fingerprint (ModelRunner's), [weights bytes, pools bytes]] or
                                        [[-1], error text]
    hidden frames (stage -> next):      [a micro-batch's hidden states [N, hidden], [seconds each stage so far
                                         computed it]]
    step payload (rank 0 -> workers):   [[arrays of each micro-batch], each micro-batch's StepInputs arrays...]
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

from tinymlx.parallel.stage_link import StageLink, StageLinkError, StageListener
from tinymlx.parallel.step_broadcast import Command, pack_text, unpack_text

FAILED = -1  # a LOAD reply's first value when the worker could not load its stage


class LinkKind(IntEnum):
    CONTROL = 0
    HIDDEN = 1


def connect(address: str, kind: LinkKind, name: str, timeout_s: float = 60.0) -> StageLink:
    """Connect to the listener at 'ip:port' and say what the link is."""
    host, port = address.rsplit(":", 1)
    link = StageLink.connect((host, int(port)), name, timeout_s)
    link.send([np.array([kind], dtype=np.int32)])
    return link


def accept(listener: StageListener, kinds: dict[LinkKind, str], timeout_s: float = 60.0) -> dict[LinkKind, StageLink]:
    """One link of each of `kinds` (kind -> the link's name), in whatever order they connect."""
    links: dict[LinkKind, StageLink] = {}
    while len(links) < len(kinds):
        link = listener.accept(" and ".join(kinds.values()), timeout_s)
        (kind,) = (int(v) for v in link.receive_host(timeout_s)[0])
        if kind not in kinds or kind in links:
            link.close()
            raise StageLinkError(f"an unexpected link of kind {kind} connected to {listener.address}")
        link.name = kinds[LinkKind(kind)]
        links[LinkKind(kind)] = link
    return links


def send_command(link: StageLink, command: Command, payload: list[np.ndarray] = ()) -> None:
    link.send([np.array([command], dtype=np.int32), *payload])


def receive_command(link: StageLink) -> tuple[Command, list[np.ndarray]]:
    command, *payload = link.receive_host()
    return Command(int(command[0])), payload


def load_reply(fingerprint: list[int] | None, memory: tuple[int, int] = (0, 0), error: str = "") -> list[np.ndarray]:
    if fingerprint is None:
        return [np.array([FAILED], dtype=np.int64), pack_text(error)]
    return [np.array(fingerprint, dtype=np.int64), np.array(memory, dtype=np.int64)]


def read_load_reply(frame: list[np.ndarray]) -> tuple[tuple[list[int], tuple[int, int]] | None, str]:
    """((the stage's fingerprint, (its weights' bytes, its pools' bytes)), "") or (None, the worker's error)."""
    if int(frame[0][0]) == FAILED:
        return None, unpack_text(frame[1])
    weights, pools = (int(v) for v in frame[1])
    return ([int(v) for v in frame[0]], (weights, pools)), ""
