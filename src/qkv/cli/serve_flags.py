"""`qkv serve`'s flags for its front door and bounds, and the range check of every flag.

    add_front_door_arguments(parser)
    door = check_serve_flags(args)      # QkvError (one line, exit 2) naming the flag, or a Door

Each flag is checked where it is read, before the model loads or a socket is bound, so a
wrong value is one line and exit code 2, never a crash at start or a server that refuses
every request.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import re
from typing import TYPE_CHECKING

from qkv.errors import QkvError

if TYPE_CHECKING:
    from qkv.serve.http.front_door import Door

_HOST_NAME = re.compile(r"^(?=.{1,253}$)[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$")
_ORIGIN = re.compile(r"^https?://[^/?#\s@]+$")
MAX_SECONDS = 3600.0


def add_front_door_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                        help="another name the server may be reached by (its Host header), besides 127.0.0.1, "
                        "localhost, [::1] and --host; repeatable. Other names are refused (DNS rebinding)")
    parser.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                        help="a web page origin (http://host:port) that may call the API from a browser, or '*' "
                        "for any; repeatable. Without it, CORS is off and other pages' requests are refused")
    parser.add_argument("--read-timeout", type=float, default=10.0, metavar="S",
                        help="seconds a connection has to send a request's headers, and then its body; "
                        "later ones get 408 and are closed (default: %(default)s)")
    parser.add_argument("--idle-timeout", type=float, default=5.0, metavar="S",
                        help="seconds an idle keep-alive connection stays open (default: %(default)s)")
    parser.add_argument("--max-connections", type=int, default=256, metavar="N",
                        help="open connections at most; one more is answered 503 and closed (default: %(default)s)")
    parser.add_argument("--prompt-timeout", type=float, default=30.0, metavar="S",
                        help="seconds to render a chat template and tokenize a prompt (off the event loop); "
                        "a slower request gets 400 (default: %(default)s)")


def _seconds(name: str, value: float) -> float:
    if not math.isfinite(value) or not 0 < value <= MAX_SECONDS:
        raise QkvError(f"{name} must be a number of seconds above 0 and at most {MAX_SECONDS:g}, got {value}")
    return value


def _at_least(name: str, value: int | None, low: int) -> None:
    if value is not None and value < low:
        raise QkvError(f"{name} must be at least {low}, got {value}")


def allowed_host(name: str) -> str:
    """An --allowed-host value checked: a host name or an IP literal, without a port."""
    bare = name.strip().lower()
    try:
        ipaddress.ip_address(bare.strip("[]"))
        return bare
    except ValueError:
        pass
    if not _HOST_NAME.match(bare):
        raise QkvError(f"--allowed-host {name!r} is not a host name or an IP address (give the name alone, "
                       "without scheme or port)")
    return bare


def cors_origin(origin: str) -> str:
    """A --cors-origin value checked: '*' or scheme://host[:port], as browsers send Origin."""
    value = origin.strip().rstrip("/")
    if value != "*" and not _ORIGIN.match(value.lower()):
        raise QkvError(f"--cors-origin {origin!r} is not an origin: give scheme://host[:port] "
                       "(e.g. http://localhost:3000) or '*'")
    return value


def check_serve_flags(args: argparse.Namespace) -> Door:
    """Every `qkv serve` flag in range; the front door's settings."""
    from qkv.serve.http.front_door import Door

    if not 0 < args.port < 65536:
        raise QkvError(f"--port must be between 1 and 65535, got {args.port}")
    _at_least("--max-batch", args.max_batch, 1)
    _at_least("--max-waiting", args.max_waiting, 0)
    _at_least("--context", args.context, 2)  # one prompt token and one new token
    _at_least("--max-tokens", args.max_tokens, 1)
    _at_least("--max-connections", args.max_connections, 1)
    if args.api_key is not None and (not args.api_key or not args.api_key.isprintable()
                                     or not args.api_key.isascii() or args.api_key.strip() != args.api_key):
        raise QkvError("--api-key must be printable ASCII without surrounding spaces, and not empty")
    return Door(host=args.host, allowed_hosts=tuple(allowed_host(name) for name in args.allowed_host),
                cors_origins=tuple(cors_origin(origin) for origin in args.cors_origin),
                read_timeout=_seconds("--read-timeout", args.read_timeout),
                idle_timeout=_seconds("--idle-timeout", args.idle_timeout),
                max_connections=args.max_connections,
                prompt_timeout=_seconds("--prompt-timeout", args.prompt_timeout))
