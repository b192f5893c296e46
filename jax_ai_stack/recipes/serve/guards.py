"""What every HTTP request to the server passes before its handler: its Host, its API key,
its body's size.

- `HostGuard` (ASGI middleware): a server bound to loopback answers only requests whose
  `Host` names loopback (localhost, 127.x.x.x, [::1], any port) or a name allowed by
  `serve --allowed-hosts`; others get a 403. A web page that rebinds its own DNS name to
  127.0.0.1 then cannot read the server from a browser, as Jupyter guards it.
- `authorize`: `Authorization: Bearer <key>` as RFC 6750 reads it (the scheme in any case,
  and required).
- `read_body`: the body, refused with a 413 past `max_bytes` (told by Content-Length, or
  found while reading) before it is held whole.

Example:
  >>> host_allowed("localhost:8000", frozenset()), host_allowed("[::1]", frozenset())
  (True, True)
  >>> host_allowed("evil.example:8000", frozenset()), host_allowed("Box:1", {"box"})
  (False, True)
"""

from __future__ import annotations

import hmac
import ipaddress
import json

from jax_ai_stack.recipes.serve import openai_api
from jax_ai_stack.recipes.serve.openai_api import ApiError

__all__ = ["HostGuard", "authorize", "host_allowed", "is_loopback", "read_body"]

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
"""The largest request body (4 MiB: a context of 100,000 tokens as text or ids fits)."""


def is_loopback(host: str) -> bool:
  """Whether the address `host` (a name or an IP) is this machine's loopback."""
  name = host.strip().strip("[]").lower().rstrip(".")
  if name == "localhost":
    return True
  try:
    return ipaddress.ip_address(name).is_loopback
  except ValueError:
    return False


def _name(header: str) -> str:
  """The host name of a Host header: lower case, without its port (an IPv6 address
  without its brackets)."""
  header = header.strip().lower()
  if header.startswith("["):
    return header[1:header.find("]")] if "]" in header else header
  return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def host_allowed(header: str, allowed: frozenset[str] | set[str]) -> bool:
  """Whether a request with this Host header is answered: a loopback name, or one of
  `allowed` (lower case names, no port; "*": any)."""
  name = _name(header)
  return "*" in allowed or bool(name) and (is_loopback(name) or name.rstrip(".") in allowed)


class HostGuard:
  """ASGI middleware: refuses (403, OpenAI's error shape) a request whose Host is neither
  loopback nor in `allowed` (see the module)."""

  def __init__(self, app, allowed: frozenset[str]):
    self.app = app
    self.allowed = frozenset(_name(name).rstrip(".") for name in allowed)  # A port dropped.

  async def __call__(self, scope, receive, send):
    if scope["type"] == "http":
      header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
      if not host_allowed(header, self.allowed):
        shown = header.encode("ascii", "backslashreplace").decode()[:100]
        error = ApiError(f"the Host header {shown!r} is not allowed: this server answers "
                         "loopback names (localhost, 127.0.0.1, [::1]); `serve "
                         "--allowed-hosts` adds others", status=403, code="host_not_allowed")
        body = json.dumps(openai_api.error_body(error)).encode()
        await send({"type": "http.response.start", "status": 403,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
        return
    await self.app(scope, receive, send)


def authorize(header: str | None, api_key: str | None) -> None:
  """Raises a 401 `ApiError` unless `header` (Authorization) is `Bearer <api_key>`, the
  scheme in any case (RFC 6750); a server without a key takes every request."""
  if api_key is None:
    return
  scheme, _, token = (header or "").strip().partition(" ")
  if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                          api_key.encode()):
    raise ApiError("Incorrect API key provided: send 'Authorization: Bearer <key>' with the "
                   "key the server was started with", status=401, code="invalid_api_key")


async def read_body(request, max_bytes: int) -> bytes:
  """The request's body; a 413 `ApiError` as soon as it is known to be over `max_bytes`."""
  def too_large(size: str) -> ApiError:
    return ApiError(f"the request body is {size} bytes; this server takes at most {max_bytes} "
                    "(serve --max-request-bytes)", status=413, code="request_too_large")

  declared = request.headers.get("content-length", "")
  if declared.isdigit() and int(declared) > max_bytes:
    raise too_large(declared)
  chunks, size = [], 0
  async for chunk in request.stream():
    size += len(chunk)
    if size > max_bytes:
      raise too_large(f"at least {size}")
    chunks.append(chunk)
  return b"".join(chunks)
