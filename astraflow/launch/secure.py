"""``astraflow up --secure``: the whole topology on the secured embedded broker, each
component as its own principal with exactly the ACLs ``topology acls`` prints.

``up`` connects as the broker's admin (``KafkaConfig.effective`` picks the secured
embedded broker's credentials), applies the topics, then ``prepare`` makes each
component's SCRAM user and ACLs (``astraflow.security.acls_apply``, passwords in
``RUNS_DIR/<run>/credentials``) and an ed25519 weight-signing key pair in
``RUNS_DIR/<run>/keys`` unless the topology names its own. ``component_env`` is what each
process gets: the ``ASTRAFLOW_*`` security overrides with its own user and password file,
the public key to verify weights with, and, for a trainer only, the private key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from astraflow.config.topology import Topology
from astraflow.errors import AstraflowError
from astraflow.kafka import security as sec
from astraflow.weights.signing import ENV_PUBLIC_KEY, ENV_SIGNING_KEY


@dataclass(frozen=True)
class SecureRun:
    """What the components of a secured run need: the CA, the passwords, the keys."""

    ca: Path
    credentials: Path
    private_key: str | None
    public_key: str | None


def component_key(topo: Topology, process: str) -> str | None:
    """The component key (``processor.batcher``, ``pool.local`` ...) of ``up``'s process
    ``process`` (``processor-batcher``, ``raas-local-0`` ...); None if none."""
    kind, _, rest = process.partition("-")
    if process == "feeder":
        return "feeder"
    if kind == "processor" and rest in topo.processors:
        return f"processor.{rest}"
    if kind in ("trainer", "eval") and rest in topo.policies:
        return f"{kind}.{rest}"
    if kind == "raas":
        pool = rest.rpartition("-")[0]
        return f"pool.{pool}" if pool in topo.pools else None
    return None


def check_embedded(topo: Topology) -> None:
    """``--secure`` runs on the embedded broker it starts: not on another cluster."""
    if os.environ.get("ASTRAFLOW_BOOTSTRAP") or topo.kafka.bootstrap_servers:
        raise AstraflowError(
            "up --secure runs on the secured embedded broker; for a cluster of your own, "
            "give kafka.security in the topology and make the users and ACLs with "
            "`astraflow topology acls FILE --apply` (docs/security.md)")
    if topo.kafka.security.enabled:
        raise AstraflowError("up --secure sets the security itself: remove kafka.security "
                             "from the topology, or run without --secure")


def _signing_keys(topo: Topology, run_dir: Path) -> tuple[str | None, str | None]:
    """The topology's weight-signing keys, else a pair made once in ``run_dir/keys``."""
    from astraflow.weights.signing import keygen

    spec = topo.weight_signing
    if spec.public_key:
        return spec.private_key, spec.public_key
    keys = run_dir / "keys"
    private, public = keys / "weights-signing.key", keys / "weights-signing.pub"
    if not (private.exists() and public.exists()):
        private, public = keygen(keys)
    return str(private), str(public)


def prepare(topo: Topology, config, run_dir: Path, log=print) -> SecureRun:
    """Users, passwords and ACLs of ``topo`` (as the admin of ``config``) and the signing
    keys; what the components need to connect."""
    from astraflow.security.acls_apply import apply

    if config.security.ca_location is None:
        raise AstraflowError("up --secure: the embedded broker is not secured")
    done = apply(topo, config, run_dir / "credentials")
    log(f"secured run {topo.run}: each component is its own principal "
        f"(User:{topo.run}.<component>); {done.summary()}")
    private, public = _signing_keys(topo, run_dir)
    return SecureRun(Path(config.security.ca_location), run_dir / "credentials",
                     private, public)


def component_env(topo: Topology, secure: SecureRun, process: str) -> dict[str, str]:
    """The environment of ``up``'s process ``process`` on a secured run."""
    key = component_key(topo, process)
    env = {sec.ENV_PROTOCOL: "SASL_SSL", sec.ENV_MECHANISM: "SCRAM-SHA-512",
           sec.ENV_CA: str(secure.ca)}
    if key is not None:
        env[sec.ENV_USERNAME] = f"{topo.run}.{key}"
        env[sec.ENV_PASSWORD_FILE] = str(secure.credentials / f"{key}.password")
    if secure.public_key:
        env[ENV_PUBLIC_KEY] = secure.public_key
    if key is not None and key.startswith("trainer.") and secure.private_key:
        env[ENV_SIGNING_KEY] = secure.private_key
    return env


__all__ = ["SecureRun", "check_embedded", "component_env", "component_key", "prepare"]
