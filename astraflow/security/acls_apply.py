"""``astraflow topology acls FILE --apply``: the SCRAM users and ACLs of a topology, made.

For every component (``astraflow.security.acls.component_acls``) that connects as ``<run>.<key>``
(the ``kafka.security.credentials_dir`` rule, or no credentials configured at all: a
component with its own ``principals`` entry or the shared default user is left alone), the
user ``<run>.<key>`` is created or updated (the SCRAM mechanism the topology names) with the
password in ``<credentials_dir>/<key>.password`` (mode 0600): kept when the file exists, a
new random one otherwise. Then every component's ALLOW rules, the operator's included, are
created unless the broker has them already. Running it again changes nothing. ACLs the
broker has beyond these are listed, never removed.

The connection is the operator's: the topology's default credentials (or the
``ASTRAFLOW_*`` environment, or a secured embedded broker's admin), which must be allowed
to alter users and ACLs (a super user, or ALTER on the cluster).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from astraflow.config.topology import Topology
from astraflow.errors import AstraflowError
from astraflow.kafka.config import KafkaConfig
from astraflow.security.acls import Acl, ComponentAcls, component_acls, principal_of
from astraflow.security.tls import write_private

USER_VISIBLE_S = 15.0  # how long a new user may take to show in describe (measured < 0.2 s)
SCRAM_ITERATIONS = 8192


@dataclass
class Applied:
    """What ``apply`` did."""

    users_created: list[str] = field(default_factory=list)
    users_kept: list[str] = field(default_factory=list)  # updated with the kept password
    acls_created: int = 0
    acls_present: int = 0
    extra: list[str] = field(default_factory=list)  # ACLs on the broker beyond the topology
    credentials_dir: Path | None = None

    def summary(self) -> str:
        lines = [f"users: {len(self.users_created)} created, {len(self.users_kept)} "
                 f"already had a password file (kept); passwords in {self.credentials_dir} "
                 "(one <key>.password file each, mode 0600)",
                 f"ACLs: {self.acls_created} created, {self.acls_present} already there"]
        lines += [f"  not in the topology (left in place): {x}" for x in self.extra]
        return "\n".join(lines)


def managed_keys(topo: Topology) -> list[str]:
    """The components whose user ``--apply`` makes: those that connect as
    ``<run>.<key>`` (no ``principals`` entry of their own, no shared default user)."""
    return [k for k in topo.component_keys()
            if principal_of(topo, k) == f"User:{topo.run}.{k}"]


def _password(path: Path) -> tuple[str, bool]:
    """The password in ``path``, or a new one written there (mode 0600); and whether it
    was new."""
    if path.exists() and path.read_text().strip():
        return path.read_text().strip(), False
    value = secrets.token_urlsafe(24)
    write_private(path, value + "\n")
    return value, True


def _mechanism(topo: Topology):
    from confluent_kafka.admin import ScramMechanism

    name = topo.kafka.security.sasl_mechanism or "SCRAM-SHA-512"
    if not name.startswith("SCRAM"):
        raise AstraflowError(f"kafka.security.sasl_mechanism {name}: --apply makes SCRAM "
                             "users only; create PLAIN users in the broker's JAAS config")
    return ScramMechanism.SCRAM_SHA_256 if name == "SCRAM-SHA-256" else \
        ScramMechanism.SCRAM_SHA_512


def apply_users(admin, topo: Topology, cred_dir: Path, out: Applied) -> None:
    """Create or update the SCRAM user of every managed component; wait until the broker
    describes them all (a user is usable only then)."""
    from confluent_kafka.admin import ScramCredentialInfo, UserScramCredentialUpsertion

    cred_dir.mkdir(parents=True, exist_ok=True)
    cred_dir.chmod(0o700)
    info = ScramCredentialInfo(_mechanism(topo), SCRAM_ITERATIONS)
    alterations, users = [], []
    for key in managed_keys(topo):
        user = f"{topo.run}.{key}"
        password, new = _password(cred_dir / f"{key}.password")
        (out.users_created if new else out.users_kept).append(user)
        alterations.append(UserScramCredentialUpsertion(user, info, password.encode()))
        users.append(user)
    if not alterations:
        return
    for future in admin.alter_user_scram_credentials(alterations).values():
        future.result()
    _await_users(admin, users)


def _await_users(admin, users: list[str]) -> None:
    from confluent_kafka import KafkaException

    deadline = time.monotonic() + USER_VISIBLE_S
    waiting = list(users)
    while waiting:
        futures = admin.describe_user_scram_credentials(waiting)
        still = []
        for user, future in futures.items():
            try:
                if not future.result().scram_credential_infos:
                    still.append(user)
            except KafkaException:
                still.append(user)
        waiting = still
        if waiting and time.monotonic() > deadline:
            raise AstraflowError(f"the broker did not show the users {', '.join(waiting)} "
                                 f"within {USER_VISIBLE_S:.0f}s of creating them")
        if waiting:
            time.sleep(0.05)


def _binding(principal: str, a: Acl):
    from confluent_kafka.admin import (
        AclBinding,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    return AclBinding(ResourceType[a.resource], a.name, ResourcePatternType[a.pattern],
                      principal, "*", AclOperation[a.operation], AclPermissionType.ALLOW)


def _key(b) -> tuple:
    return (b.restype.name, b.name, b.resource_pattern_type.name, b.principal, b.host,
            b.operation.name, b.permission_type.name)


def _existing(admin, principal: str) -> list:
    from confluent_kafka.admin import (
        AclBindingFilter,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    flt = AclBindingFilter(ResourceType.ANY, None, ResourcePatternType.ANY, principal, None,
                           AclOperation.ANY, AclPermissionType.ANY)
    return admin.describe_acls(flt).result()


def apply_acls(admin, comps: list[ComponentAcls], out: Applied) -> None:
    """Create every ALLOW rule of ``comps`` the broker does not have yet."""
    wanted = []
    for c in comps:
        have = {_key(b): b for b in _existing(admin, c.principal)}
        mine = {_key(b): b for b in (_binding(c.principal, a) for a in c.acls)}
        out.acls_present += len(set(mine) & set(have))
        wanted += [b for k, b in mine.items() if k not in have]
        out.extra += [f"{c.principal} {' '.join(map(str, k[5:6]))} {k[0].lower()} "
                      f"{k[2].lower()} {k[1]}" for k in have if k not in mine]
    if wanted:
        for future in admin.create_acls(wanted).values():
            future.result()
    out.acls_created = len(wanted)


def apply(topo: Topology, config: KafkaConfig, cred_dir: Path | None) -> Applied:
    """Users, passwords and ACLs of ``topo`` on the cluster of ``config`` (the operator's
    connection); ``cred_dir``: where the passwords go (default
    ``kafka.security.credentials_dir``)."""
    from astraflow.kafka.clients import make_admin

    where = cred_dir or (Path(topo.kafka.security.credentials_dir).expanduser()
                         if topo.kafka.security.credentials_dir else None)
    if where is None:
        raise AstraflowError("topology acls --apply: give --credentials-dir DIR (or set "
                             "kafka.security.credentials_dir): the components' passwords "
                             "are written there")
    admin = make_admin(config)
    out = Applied(credentials_dir=where)
    apply_users(admin, topo, where, out)
    apply_acls(admin, component_acls(topo), out)
    return out


__all__ = ["Applied", "apply", "apply_acls", "apply_users", "managed_keys"]
