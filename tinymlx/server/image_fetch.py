"""Fetching an http(s) image URL a request names, without letting a request probe the network the server is in.

    URL -> http(s) only -> the host resolved -> every address public (unless --allow-private-image-urls)
        -> GET sent to the address checked (Host and the TLS name kept), so a second lookup cannot rebind it
        -> a redirect's target checked the same way, at most _MAX_REDIRECTS of them
        -> the body streamed, refused once it passes the byte limit; the whole fetch within the timeout

Every failure is a 400 naming the request's part ("messages[0].content[1]: fetching ... failed: 404 Not Found").
"""

from __future__ import annotations

import ipaddress
import socket

import anyio
import httpx

from tinymlx.turns.api_error import APIError

_MAX_REDIRECTS = 3
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class ImageFetcher:
    def __init__(self, timeout_s: float = 10.0, allow_private: bool = False):
        self.timeout_s, self.allow_private = timeout_s, allow_private

    async def fetch(self, url: str, where: str, max_bytes: int) -> bytes:
        """The body of `url` (at most `max_bytes`); APIError 400 naming `where` on any failure."""
        try:
            with anyio.fail_after(self.timeout_s):
                return await self._fetch(url, where, max_bytes)
        except TimeoutError:
            raise _failed(where, url, f"no answer within {self.timeout_s:g} s") from None
        except (httpx.HTTPError, httpx.InvalidURL) as error:  # refused, reset, a bad certificate or answer, ...
            raise _failed(where, url, f"{type(error).__name__}: {error}") from None

    async def _fetch(self, url: str, where: str, max_bytes: int) -> bytes:
        # trust_env=False: no proxy from the environment, which would fetch what the checks here refused.
        async with httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=self.timeout_s) as client:
            target = httpx.URL(url)
            for _ in range(_MAX_REDIRECTS + 1):
                address = await self._address(target, where, url)
                request = client.build_request(
                    "GET", target.copy_with(host=address),
                    headers={"Host": target.netloc.decode("ascii"), "Accept": "image/*",
                             "Accept-Encoding": "identity"},  # the limit counts the bytes that will be decoded
                    extensions={"sni_hostname": target.host})
                response = await client.send(request, stream=True)
                try:
                    if response.is_redirect and "location" in response.headers:
                        target = target.join(response.headers["location"])
                        continue
                    if response.status_code != 200:
                        raise _failed(where, url, f"{response.status_code} {response.reason_phrase}".strip())
                    return await _body(response, max_bytes, where, url)
                finally:
                    await response.aclose()
        raise _failed(where, url, f"more than {_MAX_REDIRECTS} redirects")

    async def _address(self, target: httpx.URL, where: str, url: str) -> str:
        """The address to connect to: the host's first, once every address it resolves to may be fetched."""
        if target.scheme not in ("http", "https") or not target.host:
            raise _failed(where, url, f"only http(s) URLs are fetched, got {str(target)[:60]!r}")
        port = target.port or (443 if target.scheme == "https" else 80)
        try:
            found = await anyio.getaddrinfo(target.host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as error:  # unknown, or a name IDNA cannot encode
            raise _failed(where, url, f"cannot resolve {target.host!r} ({error})") from None
        addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in found]
        if not addresses:
            raise _failed(where, url, f"{target.host!r} resolves to no address")
        private = next((address for address in addresses if not is_public(address)), None)
        if private is not None and not self.allow_private:
            raise _failed(where, url, f"{target.host} is at {private}, a private, loopback, link-local or reserved "
                                      "address; the server fetches public addresses only "
                                      "(--allow-private-image-urls lifts this)")
        return str(addresses[0])


def is_public(address: IPAddress) -> bool:
    """Whether an address is on the public internet: not private, loopback, link-local, multicast, reserved or
    unspecified, and no IPv6 form (IPv4-mapped, 6to4) of one that is."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is not None and not is_public(embedded):
            return False
    return address.is_global and not address.is_multicast


async def _body(response: httpx.Response, max_bytes: int, where: str, url: str) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(where, url, max_bytes)
    data = bytearray()
    async for chunk in response.aiter_bytes():
        data += chunk
        if len(data) > max_bytes:  # a server that sent no length, or lied about it
            raise _too_large(where, url, max_bytes)
    return bytes(data)


def _too_large(where: str, url: str, max_bytes: int) -> APIError:
    return _failed(where, url, f"the image has more than {max_bytes} bytes, what the request's images may still "
                               "take (--max-image-bytes)")


def _failed(where: str, url: str, why: str) -> APIError:
    shown = url if len(url) <= 100 else url[:97] + "..."
    return APIError(400, f"{where}: fetching the image at {shown} failed: {why}", where, "invalid_image")
