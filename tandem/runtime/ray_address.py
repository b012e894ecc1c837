"""A Ray cluster's address as the command line gives it ('auto' or HOST:PORT), checked without importing Ray or the
launcher: the `--ray-address` knob of `tandem serve`, `experiment` and `plan` parses with it (tandem.knob)."""
from __future__ import annotations

import ipaddress
import re

from tandem.knob import KnobError

_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


def check_ray_address(text: str) -> str:
    """`text` if it is 'auto' or HOST:PORT (port 1-65535, a host name or IPv4/IPv6 address), else ValueError."""
    if text == "auto":
        return text
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not 'auto' or HOST:PORT (the head's GCS port, 6379 by default)")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not _HOST.match(host):
            raise ValueError(f"{text!r}: {host!r} is not a host name or IP address") from None
    return text


def ray_address(text: str) -> str:
    """--ray-address: 'auto' or HOST:PORT (checked here; the cluster is joined later)."""
    try:
        return check_ray_address(text)
    except ValueError as e:
        raise KnobError(str(e)) from None
