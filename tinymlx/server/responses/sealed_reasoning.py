"""A reasoning item's `encrypted_content`: the reasoning text itself, so that a client that stores
nothing server-side (Codex sends `store: false` and `include: ["reasoning.encrypted_content"]`) can
send it back in the next turn's input, and the chat template renders that turn the same bytes (the
prefix cache hits).

It is not encrypted: the client has the reasoning in the item's content anyway. It is checksummed
(HMAC-SHA256 under a fixed key), so a blob another server wrote, or one that was cut or edited, is
told apart and refused with a clear error rather than rendered as garbage.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import zlib

from tinymlx.turns.api_error import APIError

_PREFIX = "tinymlx-reasoning-v1."
_KEY = hashlib.sha256(b"tinymlx reasoning items").digest()
_MAC_CHARS = 32


def seal(reasoning: str) -> str:
    body = base64.urlsafe_b64encode(zlib.compress(reasoning.encode())).decode()
    return f"{_PREFIX}{body}.{_mac(body)}"


def unseal(blob: str, where: str) -> str:
    """The reasoning a seal() blob holds; a 400 naming `where` for any other blob."""
    body, _, mac = blob.removeprefix(_PREFIX).rpartition(".")
    if blob.startswith(_PREFIX) and body and hmac.compare_digest(mac, _mac(body)):
        try:
            return zlib.decompress(base64.urlsafe_b64decode(body)).decode()
        except (ValueError, zlib.error):
            pass
    raise APIError(400, f"{where}: this encrypted_content was not written by this server, or was changed; "
                        "send reasoning items back as this server returned them, or leave them out", where,
                   "invalid_encrypted_content")


def _mac(body: str) -> str:
    return hmac.new(_KEY, body.encode(), hashlib.sha256).hexdigest()[:_MAC_CHARS]
