"""The MCP server over streamable HTTP: a bearer token, Host/Origin checks, a prompt shutdown.

- **A credential on every request.** Anyone who can reach the port could otherwise run the
  tools (which write files and start processes) as the server's user: another user of the
  same machine, a web page through the browser. As notebook and language servers do, the
  server takes a token from ``ARCHON_PORT_TOKEN`` or makes one at start and prints it
  (:func:`skill.serving.server_token`); every HTTP request must carry
  ``Authorization: Bearer <token>``, else it gets ``401`` and one line saying so.
- **Host and Origin checks on every loopback host.** The SDK turns its DNS-rebinding checks
  on only for the literal hosts ``127.0.0.1``, ``localhost`` and ``::1``; here any loopback
  bind (``127.0.0.2``, ``LOCALHOST``) gets them, with that host added to the allowed names.
  A host that is not loopback (with ``--allow-remote``) serves any Host: the token guards it.
- **SIGTERM or Ctrl-C cancels the calls in flight.** uvicorn's graceful shutdown waits for
  open responses; a stage run would hold it for its whole timeout. At shutdown every running
  call is cancelled (its child process is killed, nothing is written), so the server exits
  within seconds.
"""

from __future__ import annotations

import hmac
import logging
import socket

import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.server.transport_security import TransportSecuritySettings
from starlette.types import ASGIApp, Receive, Scope, Send

from mcp_server.state import ServerState
from skill.serving import TOKEN_ENV, host_header_name, is_loopback

logger = logging.getLogger(__name__)

MCP_PATH = "/mcp"
# Seconds the shutdown waits for responses after cancelling the calls in flight.
GRACEFUL_SHUTDOWN_S = 5
_UNAUTHORIZED = (
    f"archon-port: unauthorized: send the header 'Authorization: Bearer <token>' with the token the "
    f"server printed at start (or the one in {TOKEN_ENV})\n"
).encode()


def transport_security(host: str) -> TransportSecuritySettings:
    """The Host/Origin checks for a server bound to ``host``: on for every loopback host, off otherwise."""
    if not is_loopback(host):
        return TransportSecuritySettings(enable_dns_rebinding_protection=False)
    names = dict.fromkeys(["127.0.0.1", "localhost", "[::1]", host_header_name(host)])
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=[f"{name}:*" for name in names],
        allowed_origins=[f"http://{name}:*" for name in names],
    )


class BearerTokenGate:
    """ASGI middleware: an HTTP request without ``Authorization: Bearer <token>`` gets 401 and one line."""

    def __init__(self, app: ASGIApp, token: str):
        self.app = app
        self._token = token.encode()

    def _authorized(self, scope: Scope) -> bool:
        header = next((value for name, value in scope.get("headers", ()) if name == b"authorization"), b"")
        scheme, _, credential = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(credential.strip(), self._token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" or (scope["type"] == "http" and self._authorized(scope)):
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # a websocket: this server speaks none
            await send({"type": "websocket.close", "code": 1008})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"text/plain; charset=utf-8"),
                    (b"www-authenticate", b'Bearer realm="archon-port"'),
                    (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})


class _CancellingServer(uvicorn.Server):
    """uvicorn whose shutdown first cancels the tool calls in flight, so none holds it up."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        cancelled = self.state.cancel_calls()
        if cancelled:
            logger.info("shutting down: cancelled %d call(s) in flight; they write nothing", cancelled)
        await super().shutdown(sockets)


def http_app(server: MCPServer, host: str, token: str) -> ASGIApp:
    """The streamable HTTP app of ``server`` at ``/mcp``, behind the token and the Host/Origin checks."""
    app = server.streamable_http_app(
        streamable_http_path=MCP_PATH, host=host, transport_security=transport_security(host)
    )
    return BearerTokenGate(app, token)


def serve_http(server: MCPServer, state: ServerState, host: str, port: int, token: str) -> None:
    """Serve ``server`` on ``http://host:port/mcp`` until SIGTERM or Ctrl-C (see the module docstring)."""
    config = uvicorn.Config(
        http_app(server, host, token),
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    _CancellingServer(config, state).run()
