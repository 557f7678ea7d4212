"""Who may call the API, as vLLM's flags say: ``--api-key`` (a bearer token for the ``/v1``
routes) and CORS (``--allowed-origins`` and friends). Shared by the server and the router."""

from __future__ import annotations

import argparse
import hmac
import json
import os

API_KEY_ENV = "MINENGINE_API_KEY"  # (a key on the command line shows in ps)
# beside the /v1 routes, what the key guards: a server's profiles (they write files, cost time)
GUARDED_PATHS = ("/start_profile", "/stop_profile")
_CORS_LISTS = ("allowed_origins", "allowed_methods", "allowed_headers")


def add_access_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("access (as vLLM's flags)")
    group.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"requests to /v1 (and /start_profile, /stop_profile) must send 'Authorization: Bearer <key>' "
        f"(default: ${API_KEY_ENV}, else none)",
    )
    for name in _CORS_LISTS:
        group.add_argument("--" + name.replace("_", "-"), default='["*"]', metavar="JSON", help="CORS: a JSON list")
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")


def check_access_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The CORS flags' JSON lists parsed in place, or the parser's one-line error naming the flag."""
    for name in _CORS_LISTS:
        flag, given = "--" + name.replace("_", "-"), getattr(args, name)
        try:
            value = json.loads(given)
        except ValueError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            parser.error(f"argument {flag}: {given!r}; allowed: a JSON list of strings, such as '[\"*\"]'")
        setattr(args, name, value)
    if args.api_key is not None and not args.api_key.strip():
        parser.error(f"argument --api-key: {args.api_key!r} is empty; allowed: a non-empty key")


def add_access_control(app, args: argparse.Namespace) -> None:
    """The key check, then CORS around it (so its 401s carry CORS headers, and preflights pass)."""
    from starlette.middleware.cors import CORSMiddleware

    if args.api_key is not None:
        app.add_middleware(_APIKey, api_key=args.api_key)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=args.allowed_origins,
        allow_methods=args.allowed_methods,
        allow_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials,
    )


class _APIKey:
    """ASGI middleware: a /v1 request without ``Authorization: Bearer <key>`` gets a 401, as in
    vLLM, and so does a profile's start or stop (other routes, such as /health and /metrics, and
    CORS preflights stay open)."""

    def __init__(self, app, api_key: str) -> None:
        from minengine.server.api import error_response

        self.app, self.expected, self.error_response = app, f"Bearer {api_key}".encode(), error_response

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        guarded = path.startswith("/v1") or path in GUARDED_PATHS
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and guarded:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                why = "a valid API key is needed: send the header 'Authorization: Bearer <key>'"
                await self.error_response(401, why)(scope, receive, send)
                return
        await self.app(scope, receive, send)
