"""The instance id a component runs as when none is given: the part of its consumer
group member and transactional id (``<group>.<instance>``) that tells running copies apart.

``$ASTRAFLOW_INSTANCE`` when set; else, inside a container, the container's id (stable
across restarts of that container, so a restarted copy fences its own predecessor, and
different for every replica of a scaled service: under host networking every container
shares the host's name); else the host name.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

# docker: .../containers/<id>/... in the mount table (/etc/hostname, /etc/hosts are bind
# mounts from there); podman: .../containers/<id>/userdata/...; cgroup v1: /docker/<id>
_CONTAINER = re.compile(r"/(?:containers|overlay-containers|docker|libpod-)/?([0-9a-f]{64})")


def container_id(proc: Path = Path("/proc/self")) -> str | None:
    """This process's container id (64 hex digits) as the kernel's tables show it, or
    None outside a container."""
    for name in ("mountinfo", "cgroup"):
        try:
            text = (proc / name).read_text()
        except OSError:
            continue
        m = _CONTAINER.search(text)
        if m:
            return m.group(1)
    return None


def default_instance() -> str:
    """``$ASTRAFLOW_INSTANCE``, else the container's short id (12 digits), else the host
    name (see the module docstring)."""
    env = os.environ.get("ASTRAFLOW_INSTANCE")
    if env:
        return env
    cid = container_id()
    return cid[:12] if cid else socket.gethostname()


__all__ = ["container_id", "default_instance"]
