"""The default instance id (``astraflow.kafka.instance``): unique per container, stable
across a container's restarts, the host name outside one."""

from __future__ import annotations

import socket

from astraflow.kafka import instance

CID = "4f1c2b3a" * 8  # 64 hex digits

DOCKER_MOUNTINFO = (
    "1021 1003 0:123 / / rw,relatime - overlay overlay rw,lowerdir=/var/lib/docker/overlay2/l\n"
    f"1040 1021 254:1 /var/lib/docker/containers/{CID}/hostname /etc/hostname rw - ext4 "
    "/dev/vda rw\n")
PODMAN_MOUNTINFO = (
    f"712 690 0:52 /containers/overlay-containers/{CID}/userdata/hostname /etc/hostname "
    "rw - tmpfs tmpfs rw\n")
CGROUP_V1 = f"12:pids:/docker/{CID}\n11:memory:/docker/{CID}\n"
HOST_MOUNTINFO = "22 1 254:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw\n"


def _proc(tmp_path, **files):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_container_id_is_read_from_the_kernels_tables(tmp_path):
    for d in "dpch":
        (tmp_path / d).mkdir()
    assert instance.container_id(_proc(tmp_path / "d", mountinfo=DOCKER_MOUNTINFO)) == CID
    assert instance.container_id(_proc(tmp_path / "p", mountinfo=PODMAN_MOUNTINFO)) == CID
    assert instance.container_id(_proc(tmp_path / "c", mountinfo=HOST_MOUNTINFO,
                                       cgroup=CGROUP_V1)) == CID
    assert instance.container_id(_proc(tmp_path / "h", mountinfo=HOST_MOUNTINFO,
                                       cgroup="0::/user.slice\n")) is None


def test_the_default_instance(monkeypatch):
    monkeypatch.setenv("ASTRAFLOW_INSTANCE", "node-7")
    assert instance.default_instance() == "node-7"
    monkeypatch.delenv("ASTRAFLOW_INSTANCE")
    monkeypatch.setattr(instance, "container_id", lambda: CID)
    assert instance.default_instance() == CID[:12]
    monkeypatch.setattr(instance, "container_id", lambda: None)
    assert instance.default_instance() == socket.gethostname()
