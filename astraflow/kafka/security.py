"""Kafka security settings in one place: TLS, SASL and each component's credentials.

The topology's ``kafka.security`` section (``KafkaSecurity``) holds the protocol, the SASL
mechanism, the CA and client certificate paths, and credentials: a default ``username``
with a password *source*, per-component ``principals``, or a ``credentials_dir`` that holds
one password file per component. Environment variables (``ENV_*`` below) override the
topology for the process that reads them, so a deployment can give each service its own.

A password is never a value in the topology or in any config object: only the name of an
environment variable (``password_env``) or a file (``password_file``) that holds it. The
secret is read when a client is made (``client_settings``) and goes straight into the
librdkafka configuration; ``redact`` masks secrets in any librdkafka mapping that is shown.
Errors name the offending key, never a secret's value.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from astraflow.errors import AstraflowError

REDACTED = "[redacted]"
# librdkafka and schema-registry properties that hold a secret (besides every key that
# contains "password" or "secret")
SECRET_OPTIONS = frozenset({
    "ssl.key.pem", "ssl_key", "basic.auth.user.info", "bearer.auth.token",
    "sasl.oauthbearer.config", "sasl.jaas.config",
})
# what kafka.security sets: refused in kafka.options once the security section is used
SECURITY_OPTIONS = frozenset({
    "security.protocol", "sasl.mechanism", "sasl.mechanisms", "sasl.username",
    "ssl.ca.location", "ssl.certificate.location", "ssl.key.location",
})

# environment overrides, winning over the topology (each process its own)
ENV_PROTOCOL = "ASTRAFLOW_SECURITY_PROTOCOL"
ENV_MECHANISM = "ASTRAFLOW_SASL_MECHANISM"
ENV_USERNAME = "ASTRAFLOW_SASL_USERNAME"
ENV_PASSWORD = "ASTRAFLOW_SASL_PASSWORD"
ENV_PASSWORD_FILE = "ASTRAFLOW_SASL_PASSWORD_FILE"
ENV_CA = "ASTRAFLOW_SSL_CA_LOCATION"
ENV_CERTIFICATE = "ASTRAFLOW_SSL_CERTIFICATE_LOCATION"
ENV_KEY = "ASTRAFLOW_SSL_KEY_LOCATION"
ENV_KEY_PASSWORD = "ASTRAFLOW_SSL_KEY_PASSWORD"
ENV_KEY_PASSWORD_FILE = "ASTRAFLOW_SSL_KEY_PASSWORD_FILE"
# the client-certificate overrides (mutual TLS): one process's, never passed on
ENV_SSL_KEYS = (ENV_CERTIFICATE, ENV_KEY, ENV_KEY_PASSWORD, ENV_KEY_PASSWORD_FILE)

Protocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
Mechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]
INLINE_SECRET = ("a password is never written in the topology: name an environment "
                 "variable (password_env) or a file (password_file) that holds it")


class SecurityConfigError(AstraflowError, ValueError):
    """Security settings that cannot make a client; the message names the key, not a secret
    (the CLI prints it as one line)."""


def is_secret_option(key: str) -> bool:
    """Whether the librdkafka (or schema-registry) property ``key`` holds a secret."""
    k = key.lower()
    return k in SECRET_OPTIONS or "password" in k or "secret" in k


def check_no_secrets(options: Mapping[str, Any], where: str) -> None:
    """Raise ``ValueError`` ``where.key: ...`` for the first option that holds a secret."""
    for key in options:
        if is_secret_option(str(key)):
            raise ValueError(f"{where}.{key}: {INLINE_SECRET}")


def redact(conf: Mapping[str, Any]) -> dict[str, Any]:
    """``conf`` with the value of every secret property replaced by ``[redacted]``."""
    return {k: REDACTED if is_secret_option(str(k)) else v for k, v in conf.items()}


def _refuse_inline(data: Any) -> Any:
    if isinstance(data, dict) and "password" in data:
        raise ValueError(f".password: {INLINE_SECRET}")
    return data


class SecretSource(BaseModel):
    """Where a secret is read from: an environment variable or a file, at most one."""

    model_config = ConfigDict(extra="forbid")

    password_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    password_file: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_inline(cls, data: Any) -> Any:
        return _refuse_inline(data)

    @model_validator(mode="after")
    def _one_source(self) -> SecretSource:
        if self.password_env and self.password_file:
            raise ValueError(".password_file: give password_env or password_file, not both")
        return self

    @property
    def given(self) -> bool:
        return bool(self.password_env or self.password_file)

    def describe(self) -> str:
        """Where the secret comes from, never the secret."""
        if self.password_env:
            return f"${self.password_env}"
        if self.password_file:
            return f"file {self.password_file}"
        return "none"

    def read(self, key: str) -> str:
        """The secret; ``SecurityConfigError`` naming ``key`` and the source if unreadable."""
        if self.password_env:
            value = os.environ.get(self.password_env)
            if value is None:
                raise SecurityConfigError(
                    f"{key}.password_env: environment variable {self.password_env} is not set")
            return value
        if self.password_file:
            try:
                return Path(self.password_file).expanduser().read_text().rstrip("\r\n")
            except OSError as e:
                raise SecurityConfigError(
                    f"{key}.password_file: cannot read {self.password_file}: "
                    f"{e.strerror}") from None
        raise SecurityConfigError(f"{key}: no password_env or password_file")


class Credentials(SecretSource):
    """One principal's SASL credentials: a username and where its password is."""

    username: str | None = Field(default=None, min_length=1)


class KafkaSecurity(Credentials):
    """``kafka.security``: TLS and SASL settings of every client, and their credentials.

    ``username`` with ``password_env``/``password_file`` are the default credentials (and
    the operator commands'); ``principals`` maps a component key (``feeder``,
    ``processor.<name>``, ``pool.<pool>``, ``trainer.<policy>``, ``eval.<policy>``) to its own;
    with ``credentials_dir`` a component without an entry is user ``<run>.<key>`` with its
    password in ``<credentials_dir>/<key>.password``.
    """

    protocol: Protocol = "PLAINTEXT"
    sasl_mechanism: Mechanism | None = None  # default SCRAM-SHA-512 under SASL
    ca_location: str | None = None
    certificate_location: str | None = None
    key_location: str | None = None
    key_password: SecretSource = Field(default_factory=SecretSource)
    check_hostname: bool = True  # ssl.endpoint.identification.algorithm https
    principals: dict[str, Credentials] = Field(default_factory=dict)
    credentials_dir: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_inline_key_password(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("key_password"), str):
            raise ValueError(f".key_password: {INLINE_SECRET}")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> KafkaSecurity:
        tls, sasl = self.protocol in ("SSL", "SASL_SSL"), self.protocol.startswith("SASL")
        if not tls:
            for name in ("ca_location", "certificate_location", "key_location"):
                if getattr(self, name):
                    raise ValueError(f".{name}: set with protocol {self.protocol}, which does "
                                     "not use TLS (SSL or SASL_SSL)")
        if not sasl:
            for name in ("username", "sasl_mechanism", "credentials_dir"):
                if getattr(self, name):
                    raise ValueError(f".{name}: set with protocol {self.protocol}, which does "
                                     "not use SASL (SASL_PLAINTEXT or SASL_SSL)")
            if self.principals:
                raise ValueError(f".principals: set with protocol {self.protocol}, which does "
                                 "not use SASL (SASL_PLAINTEXT or SASL_SSL)")
        if bool(self.certificate_location) != bool(self.key_location):
            raise ValueError(".key_location: a client certificate needs its key and the key "
                             "its certificate (certificate_location and key_location)")
        return self

    @property
    def uses_sasl(self) -> bool:
        return self.protocol.startswith("SASL")

    @property
    def enabled(self) -> bool:
        """Whether anything here differs from PLAINTEXT without credentials."""
        return self != KafkaSecurity()

    def username_for(self, key: str | None, run: str) -> str | None:
        """The username component ``key`` connects as (None: default credentials, if any)."""
        if key is not None and key in self.principals and self.principals[key].username:
            return self.principals[key].username
        if key is not None and self.credentials_dir:
            return f"{run}.{key}"
        return self.username

    def for_component(self, key: str, run: str) -> KafkaSecurity:
        """These settings with the credentials of component ``key`` as the default ones."""
        own = self.principals.get(key)
        if own is not None:
            creds = own.model_dump()
            creds["username"] = own.username or self.username
        elif self.credentials_dir:
            path = str(Path(self.credentials_dir) / f"{key}.password")
            creds = {"username": f"{run}.{key}", "password_env": None, "password_file": path}
        else:
            return self
        return self.model_copy(update={**creds, "principals": {}, "credentials_dir": None})

    def with_env(self, environ: Mapping[str, str] | None = None) -> KafkaSecurity:
        """These settings with the ``ASTRAFLOW_*`` overrides of ``environ`` (default: the
        process environment) applied; a password from the environment stays a reference."""
        env = os.environ if environ is None else environ
        data = self.model_dump()
        for var, name in ((ENV_PROTOCOL, "protocol"), (ENV_MECHANISM, "sasl_mechanism"),
                          (ENV_USERNAME, "username"), (ENV_CA, "ca_location"),
                          (ENV_CERTIFICATE, "certificate_location"), (ENV_KEY, "key_location")):
            if env.get(var):
                data[name] = env[var]
        for var, var_file, target in ((ENV_PASSWORD, ENV_PASSWORD_FILE, data),
                                      (ENV_KEY_PASSWORD, ENV_KEY_PASSWORD_FILE,
                                       data["key_password"])):
            if env.get(var):
                target.update(password_env=var, password_file=None)
            elif env.get(var_file):
                target.update(password_env=None, password_file=env[var_file])
        try:
            return KafkaSecurity(**data)
        except ValueError as e:
            raise SecurityConfigError(f"kafka.security{_first_error(e)} (the ASTRAFLOW_* "
                                      "environment overrides applied)") from None

    def describe(self) -> str:
        """One line for ``topology explain``: settings and password sources, no secret."""
        parts = [self.protocol]
        if self.uses_sasl:
            parts.append(self.sasl_mechanism or "SCRAM-SHA-512")
            if self.username:
                parts.append(f"user {self.username} (password from {self.describe_source()})")
        for label, path in (("CA", self.ca_location), ("certificate", self.certificate_location),
                            ("key", self.key_location)):
            if path:
                parts.append(f"{label} {path}")
        if self.principals:
            parts.append("own credentials for " + ", ".join(sorted(self.principals)))
        if self.credentials_dir:
            parts.append(f"other components' passwords in {self.credentials_dir}")
        return ", ".join(parts)

    def describe_source(self) -> str:
        return SecretSource(password_env=self.password_env,
                            password_file=self.password_file).describe()


def _first_error(e: ValueError) -> str:
    """``.key: message`` of the first error of a validation error."""
    errors = getattr(e, "errors", None)
    if not callable(errors):
        return f": {e}"
    err = errors()[0]
    loc = "".join(f".{x}" for x in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    return f"{loc}{msg}" if msg.startswith(".") else f"{loc}: {msg}"


def client_settings(security: KafkaSecurity) -> dict[str, Any]:
    """The librdkafka properties of ``security`` with environment overrides applied, secrets
    read now; ``SecurityConfigError`` naming the key when a needed setting is missing."""
    sec = security.with_env()
    if not sec.enabled:
        return {}
    conf: dict[str, Any] = {"security.protocol": sec.protocol}
    if sec.uses_sasl:
        if not sec.username:
            raise SecurityConfigError(
                f"kafka.security.username: protocol {sec.protocol} needs a username (or "
                f"{ENV_USERNAME}, or the component's entry under kafka.security.principals)")
        if not sec.given:
            raise SecurityConfigError(
                f"kafka.security.password_env: user {sec.username} has no password source "
                f"(password_env, password_file, {ENV_PASSWORD} or {ENV_PASSWORD_FILE})")
        conf.update({"sasl.mechanism": sec.sasl_mechanism or "SCRAM-SHA-512",
                     "sasl.username": sec.username,
                     "sasl.password": sec.read("kafka.security")})
    if sec.protocol in ("SSL", "SASL_SSL"):
        conf["ssl.endpoint.identification.algorithm"] = "https" if sec.check_hostname else "none"
        for prop, path in (("ssl.ca.location", sec.ca_location),
                           ("ssl.certificate.location", sec.certificate_location),
                           ("ssl.key.location", sec.key_location)):
            if path:
                conf[prop] = path
        if sec.key_password.given:
            conf["ssl.key.password"] = sec.key_password.read("kafka.security.key_password")
    return conf


__all__ = [
    "Credentials",
    "KafkaSecurity",
    "SecretSource",
    "SecurityConfigError",
    "check_no_secrets",
    "client_settings",
    "is_secret_option",
    "redact",
]
