"""Addresses the server listens on and gives to clients (stdlib only: the UI uses it too)."""

from __future__ import annotations

import ipaddress

DEFAULT_HOST = "127.0.0.1"  # loopback unless the user chooses otherwise
DEFAULT_PORT = 8080


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def address(host: str, port: int) -> str:
    """The base URL an OpenAI client is given."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{port}/v1"
