"""When Kafka refuses a client: denials, bad credentials and certificate problems.

librdkafka retries a failed SASL login forever (about three times a second, each with an
``error_cb`` call), and reports a refused operation as an error code without saying who
was refused what. A component must instead stop at once with one line naming its
principal, the operation and the resource, and exit non-zero without being restarted
(``EXIT_REFUSED``). This module is the one place that decides this:

- ``KafkaAccessError``: the error every such refusal becomes (an ``AstraflowError``: the
  CLI prints it as one line and exits with ``EXIT_REFUSED``).
- ``check_login``: run by ``KafkaConfig`` once per process and credentials before the
  first client under SASL or TLS is made; a wrong password or an untrusted, expired or
  misnamed broker certificate fails there within a few seconds.
- ``guarded_error_cb``: wraps every client's ``error_cb`` (``KafkaConfig``), so that an
  authentication or TLS failure later (a rotated password) raises out of the client's
  ``poll``/``consume``/``flush`` instead of being retried.
- ``refusal``: a ``KafkaAccessError`` naming the operation and resource for an
  authorization error code (topic, group, transactional id, cluster), or None.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import KafkaError

from astraflow.errors import AstraflowError

log = logging.getLogger("astraflow.kafka")

EXIT_REFUSED = 77  # sysexits EX_NOPERM: `astraflow up` does not restart such a component
LOGIN_TIMEOUT_S = 8.0  # check_login gives up (and leaves it to the clients) after this

# authorization error code -> the resource kind it is about
AUTHORIZATION = {
    KafkaError.TOPIC_AUTHORIZATION_FAILED: "topic",
    KafkaError.GROUP_AUTHORIZATION_FAILED: "group",
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED: "transactional id",
    KafkaError.CLUSTER_AUTHORIZATION_FAILED: "cluster",
}
AUTHENTICATION = {KafkaError._AUTHENTICATION, KafkaError.SASL_AUTHENTICATION_FAILED}
HINT = ("grant it (`astraflow topology acls FILE --apply`, or the cluster's operator), "
        "or run it as a principal that has it")


class KafkaAccessError(AstraflowError):
    """Kafka refused this client: an operation denied, bad credentials, or a certificate
    problem. Retrying cannot help; the message says who, what and why, never a secret."""


def principal_of_conf(conf: Mapping[str, Any]) -> str:
    """``User:<name>`` a librdkafka configuration authenticates as (``User:ANONYMOUS``
    without SASL)."""
    protocol = str(conf.get("security.protocol", "PLAINTEXT")).upper()
    user = conf.get("sasl.username") if protocol.startswith("SASL") else None
    return f"User:{user or 'ANONYMOUS'}"


def refusal(err: KafkaError | None, principal: str, operation: str,
            resource: str | None = None) -> KafkaAccessError | None:
    """The one-line error for an authorization error ``err`` (None for any other error):
    ``principal`` was denied ``operation`` on ``resource`` (e.g. ``topic run.weights``)."""
    if err is None or err.code() not in AUTHORIZATION:
        return None
    kind = AUTHORIZATION[err.code()]
    what = resource if resource else (kind if kind == "cluster" else f"a {kind}")
    return KafkaAccessError(f"{principal} was denied {operation} on {what} "
                            f"({err.name()}); {HINT}")


def bad_login(principal: str, bootstrap: str, detail: str) -> KafkaAccessError:
    return KafkaAccessError(
        f"{principal}: Kafka at {bootstrap} refused the login (wrong username or password, "
        f"or a user the cluster does not know): {detail}")


def certificate_problem(bootstrap: str, ca_location: str | None,
                        check_hostname: bool = True, timeout: float = 5.0) -> str | None:
    """What is wrong with the broker's certificate, by a TLS handshake of our own with the
    first bootstrap server (e.g. ``certificate has expired``, ``self-signed certificate in
    certificate chain``, ``IP address mismatch``); None if it verifies or cannot be
    reached."""
    host, _, port = bootstrap.split(",")[0].strip().rpartition(":")
    host = host.strip("[]")
    ctx = ssl.create_default_context(cafile=ca_location) if ca_location else \
        ssl.create_default_context()
    ctx.check_hostname = check_hostname
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as raw, \
                ctx.wrap_socket(raw, server_hostname=host):
            return None
    except ssl.SSLCertVerificationError as e:
        trusted = f"the CA in {ca_location}" if ca_location else "the system's CAs"
        return (f"the broker's certificate at {host}:{port} does not verify against "
                f"{trusted}: {e.verify_message}")
    except (OSError, ValueError, ssl.SSLError):
        return None


def tls_failure(conf: Mapping[str, Any], detail: str) -> KafkaAccessError:
    """The error for a failed TLS handshake: the certificate problem named when a
    handshake of our own finds it, else librdkafka's words."""
    bootstrap = str(conf.get("bootstrap.servers", "?"))
    problem = certificate_problem(
        bootstrap, conf.get("ssl.ca.location"),
        conf.get("ssl.endpoint.identification.algorithm", "https") != "none")
    return KafkaAccessError(f"{principal_of_conf(conf)}: TLS with Kafka at {bootstrap} "
                            f"failed: {problem or detail}")


def _is_tls(err: KafkaError) -> bool:
    text = err.str().lower()
    return err.code() == KafkaError._SSL or "ssl handshake failed" in text \
        or "certificate verify failed" in text


def access_failure(err: KafkaError, conf: Mapping[str, Any]) -> KafkaAccessError | None:
    """The ``KafkaAccessError`` for a client error that retrying cannot fix: a refused
    login or a failed TLS handshake; None for others."""
    if err.code() in AUTHENTICATION:
        return bad_login(principal_of_conf(conf), str(conf.get("bootstrap.servers", "?")),
                         err.str())
    if _is_tls(err):
        return tls_failure(conf, err.str())
    return None


def guarded_error_cb(conf: Mapping[str, Any],
                     inner: Callable[[KafkaError], None] | None) -> Callable[[KafkaError], None]:
    """An ``error_cb`` that raises ``KafkaAccessError`` (out of the client call that
    served it) on a refused login or a failed TLS handshake, and hands every other error
    to ``inner`` (else logs it at debug)."""
    shown = {k: conf.get(k) for k in ("bootstrap.servers", "security.protocol",
                                     "sasl.username", "ssl.ca.location",
                                     "ssl.endpoint.identification.algorithm")}

    def on_error(err: KafkaError) -> None:
        failure = access_failure(err, shown)
        if failure is not None:
            raise failure
        if inner is not None:
            inner(err)
        else:
            log.debug("Kafka client error: %s", err)

    return on_error


def without_write(admin_conf: Mapping[str, Any], topics: list[str],
                  timeout_s: float = 10.0) -> list[str]:
    """Those of ``topics`` the principal of ``admin_conf`` may not WRITE, as the broker
    says (DescribeTopics with the authorized operations). A transaction refused by a topic
    does not say which one (librdkafka: "Failed to add partition(s) to transaction");
    this names it. Empty when the broker cannot say."""
    from confluent_kafka import KafkaException, TopicCollection
    from confluent_kafka.admin import AclOperation, AdminClient

    allowed = {AclOperation.WRITE, AclOperation.ALL}
    out = []
    admin = AdminClient(dict(admin_conf))  # held until the futures are done
    try:
        futures = admin.describe_topics(
            TopicCollection(list(topics)), include_authorized_operations=True,
            request_timeout=timeout_s)
    except KafkaException:
        return []
    for topic, future in futures.items():
        try:
            ops = set(future.result().authorized_operations or [])
        except KafkaException as e:  # not even DESCRIBE: no WRITE either
            if e.args and getattr(e.args[0], "code", lambda: None)() in AUTHORIZATION:
                out.append(topic)
            continue
        if not ops & allowed:
            out.append(topic)
    return [t for t in topics if t in out]


_checked: set[tuple[str, ...]] = set()  # a password only as its sha256
_lock = threading.Lock()


def check_login(conf: Mapping[str, Any], timeout_s: float = LOGIN_TIMEOUT_S) -> None:
    """Make sure ``conf``'s credentials and TLS settings get a client in: once per process
    and (bootstrap, protocol, user, password, CA). Raises ``KafkaAccessError`` on a refused
    login or a certificate problem; returns quietly when the broker does not answer (the clients'
    outage handling waits for it) or after ``timeout_s``."""
    protocol = str(conf.get("security.protocol", "PLAINTEXT")).upper()
    if protocol == "PLAINTEXT":
        return
    secret = hashlib.sha256(str(conf.get("sasl.password")).encode()).hexdigest()
    key = (str(conf.get("bootstrap.servers")), protocol, str(conf.get("sasl.username")),
           secret, str(conf.get("ssl.ca.location")))
    with _lock:
        if key in _checked:
            return
        _try_login(conf, timeout_s)  # a refusal raises: checked again by the next client
        _checked.add(key)  # in, or no answer: later failures reach the guarded error_cb


def _try_login(conf: Mapping[str, Any], timeout_s: float) -> bool:
    """One probe client: True once it reads metadata; raises on a refusal."""
    from confluent_kafka import KafkaException, Producer

    errors: list[KafkaError] = []
    keep = ("bootstrap.servers", "client.id", "logger")
    probe_conf = {k: v for k, v in conf.items()
                  if k in keep or k.startswith(("security.", "sasl.", "ssl."))}
    try:
        probe = Producer({**probe_conf, "error_cb": errors.append})
    except KafkaException:  # a bad setting: the real client fails with it, and says so
        return False
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            for err in errors:
                failure = access_failure(err, conf)
                if failure is not None:
                    raise failure
            if any(e.code() == KafkaError._ALL_BROKERS_DOWN for e in errors):
                return False  # no broker answers: the clients' outage handling waits
            errors.clear()
            try:
                probe.list_topics(timeout=0.5)
                return True
            except KafkaException:
                probe.poll(0.1)
        return False
    finally:
        probe.flush(0)


__all__ = ["EXIT_REFUSED", "KafkaAccessError", "access_failure", "certificate_problem",
           "check_login", "guarded_error_cb", "principal_of_conf", "refusal", "without_write"]
