"""Kafka security settings: one place, per-component credentials, secrets never shown."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from astraflow.cli.topology import explain
from astraflow.config.topology import TopologyError, load_topology, parse_topology
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.security import (
    ENV_PASSWORD,
    ENV_PROTOCOL,
    ENV_USERNAME,
    KafkaSecurity,
    SecurityConfigError,
    client_settings,
    redact,
)

REPO = Path(__file__).resolve().parents[3]
SECRET = "s3cr3t-Pa55-do-not-print"
KEY_SECRET = "k3y-Pa55-do-not-print"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("ASTRAFLOW_SECURITY_PROTOCOL", "ASTRAFLOW_SASL_MECHANISM",
                "ASTRAFLOW_SASL_USERNAME", "ASTRAFLOW_SASL_PASSWORD",
                "ASTRAFLOW_SASL_PASSWORD_FILE", "ASTRAFLOW_SSL_CA_LOCATION",
                "ASTRAFLOW_SSL_CERTIFICATE_LOCATION", "ASTRAFLOW_SSL_KEY_LOCATION",
                "ASTRAFLOW_SSL_KEY_PASSWORD", "ASTRAFLOW_SSL_KEY_PASSWORD_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ASTRAFLOW_BOOTSTRAP", "broker:9093")


def secured(tmp_path: Path, **security) -> dict:
    """The default topology's data with a ``kafka.security`` section."""
    import yaml

    data = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())
    data.setdefault("kafka", {})["security"] = {
        "protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
        "username": "ops", "password_env": "OPS_PASSWORD",
        "ca_location": str(tmp_path / "ca.pem"), **security}
    return data


def test_settings_reach_every_client_with_the_component_credentials(tmp_path, monkeypatch):
    (tmp_path / "trainer.pw").write_text(SECRET + "\n")
    monkeypatch.setenv("OPS_PASSWORD", "ops-pw")
    topo = parse_topology(secured(tmp_path, principals={
        "trainer.actor": {"username": "alice", "password_file": str(tmp_path / "trainer.pw")}}))
    trainer = topo.component_kafka("trainer.actor")
    for conf in (trainer.admin_conf(), trainer.producer_conf(), trainer.consumer_conf("g")):
        assert conf["security.protocol"] == "SASL_SSL"
        assert conf["sasl.mechanism"] == "SCRAM-SHA-512"
        assert (conf["sasl.username"], conf["sasl.password"]) == ("alice", SECRET)
        assert conf["ssl.ca.location"] == str(tmp_path / "ca.pem")
    other = topo.component_kafka("pool.local").admin_conf()  # no entry: the default user
    assert (other["sasl.username"], other["sasl.password"]) == ("ops", "ops-pw")


def test_credentials_dir_gives_each_component_its_own_user(tmp_path):
    (tmp_path / "pool.local.password").write_text("pool-pw")
    topo = parse_topology(secured(tmp_path, credentials_dir=str(tmp_path)))
    conf = topo.component_kafka("pool.local").producer_conf()
    assert (conf["sasl.username"], conf["sasl.password"]) == ("default.pool.local", "pool-pw")
    with pytest.raises(SecurityConfigError,
                       match=r"password_file: cannot read .*/trainer.actor.password"):
        topo.component_kafka("trainer.actor").producer_conf()


def test_environment_overrides_the_topology(tmp_path, monkeypatch):
    monkeypatch.setenv("OPS_PASSWORD", "ops-pw")
    monkeypatch.setenv(ENV_USERNAME, "bob")
    monkeypatch.setenv(ENV_PASSWORD, SECRET)
    topo = parse_topology(secured(tmp_path))
    conf = topo.component_kafka("feeder").admin_conf()
    assert (conf["sasl.username"], conf["sasl.password"]) == ("bob", SECRET)
    monkeypatch.setenv(ENV_PROTOCOL, "SASL_PLAINTEXT")
    with pytest.raises(SecurityConfigError, match=r"ca_location: set with protocol SASL_PLAIN"):
        topo.kafka.admin_conf()
    # the environment alone secures a topology that says nothing of security
    monkeypatch.delenv(ENV_PROTOCOL)
    plain = KafkaConfig()
    with pytest.raises(SecurityConfigError, match=r"^kafka.security.username: set with "
                                                  r"protocol PLAINTEXT.*ASTRAFLOW_\*"):
        plain.admin_conf()  # a username from the environment needs a SASL protocol
    monkeypatch.setenv(ENV_PROTOCOL, "SASL_PLAINTEXT")
    assert plain.admin_conf()["sasl.username"] == "bob"
    monkeypatch.delenv(ENV_PROTOCOL)
    monkeypatch.delenv(ENV_USERNAME)
    monkeypatch.delenv(ENV_PASSWORD)
    assert client_settings(plain.security) == {}


@pytest.mark.parametrize("security,key", [
    ({"password": SECRET}, "kafka.security.password"),
    ({"principals": {"pool.local": {"username": "u", "password": SECRET}}},
     "kafka.security.principals.pool.local.password"),
    ({"key_password": SECRET}, "kafka.security.key_password"),
    ({"protocol": "SASL_SSL", "password_file": "/x"}, "kafka.security.password_file"),
    ({"protocol": "PLAINTEXT", "ca_location": None}, "kafka.security.username"),
    ({"principals": {"trainer.nobody": {"username": "u"}}},
     "kafka.security.principals.trainer.nobody"),
    ({"protocol": "TLS"}, "kafka.security.protocol"),
    ({"certificate_location": "/c.pem"}, "kafka.security.key_location"),
])
def test_bad_security_fails_at_load_naming_the_key(tmp_path, security, key):
    with pytest.raises(TopologyError) as e:
        parse_topology(secured(tmp_path, **security), source="t.yaml")
    assert f"t.yaml: {key}" in str(e.value)
    assert SECRET not in str(e.value)


@pytest.mark.parametrize("where", ["options", "producer_options", "consumer_options",
                                   "schema_registry_options"])
@pytest.mark.parametrize("option", ["sasl.password", "ssl.key.password", "ssl.key.pem",
                                    "basic.auth.user.info", "sasl.oauthbearer.client.secret"])
def test_a_secret_as_a_librdkafka_option_fails_at_load(where, option):
    with pytest.raises(TopologyError) as e:
        parse_topology({"run": "r", "kafka": {where: {option: SECRET}}}, source="t.yaml")
    assert f"t.yaml: kafka.{where}.{option}: a password is never written" in str(e.value)
    assert SECRET not in str(e.value)


def test_a_pool_secret_fails_at_load_too():
    data = {"run": "r", "topics": {"tasks": {}}, "pools": {
        "remote": {"kafka": {"options": {"sasl.password": SECRET}}}}}
    with pytest.raises(TopologyError) as e:
        parse_topology(data, source="t.yaml")
    assert "pools.remote.kafka.options.sasl.password" in str(e.value)
    assert SECRET not in str(e.value)


def test_security_options_are_set_in_one_place(tmp_path):
    data = secured(tmp_path)
    data["kafka"]["options"] = {"security.protocol": "PLAINTEXT"}
    with pytest.raises(TopologyError, match="kafka.options.security.protocol: set by kafka.sec"):
        parse_topology(data, source="t.yaml")


def test_missing_password_or_username_is_one_line_naming_the_key(tmp_path, monkeypatch):
    topo = parse_topology(secured(tmp_path))
    with pytest.raises(SecurityConfigError, match="password_env: environment variable "
                                                  "OPS_PASSWORD is not set"):
        topo.kafka.producer_conf()
    sec = KafkaSecurity(protocol="SASL_SSL")
    with pytest.raises(SecurityConfigError, match="kafka.security.username: protocol SASL_SSL"):
        client_settings(sec)


def test_no_secret_is_ever_shown(tmp_path, monkeypatch, caplog, capsys):
    """explain, repr/str/dumps of every config object, errors and logged configs: the
    passwords appear nowhere (only in the librdkafka mapping itself, and redacted there)."""
    (tmp_path / "pool.pw").write_text(SECRET)
    monkeypatch.setenv("OPS_PASSWORD", SECRET)
    monkeypatch.setenv(ENV_PASSWORD, SECRET)
    monkeypatch.setenv("ASTRAFLOW_SSL_KEY_PASSWORD", KEY_SECRET)
    path = tmp_path / "t.yaml"
    import yaml

    path.write_text(yaml.safe_dump(secured(tmp_path, principals={
        "pool.local": {"username": "p", "password_file": str(tmp_path / "pool.pw")}},
        certificate_location="/c.pem", key_location="/k.pem")))
    topo = load_topology(path)
    pool = topo.component_kafka("pool.local")
    conf = pool.producer_conf()
    assert conf["sasl.password"] == SECRET and conf["ssl.key.password"] == KEY_SECRET
    shown = [explain(topo), repr(topo), str(topo), topo.model_dump_json(), repr(pool), str(pool),
             pool.model_dump_json(), repr(pool.security.with_env()),
             repr(redact(conf)), str(redact(pool.consumer_conf("g")))]
    logging.getLogger("astraflow.test").info("config %s", redact(conf))
    from astraflow.security.acls import component_acls, format_table, to_json

    shown += [format_table(topo, component_acls(topo)), to_json(topo, component_acls(topo))]
    for bad in ({"password": SECRET}, {"options": {"sasl.password": SECRET}}):
        data = secured(tmp_path, **bad) if "password" in bad else {
            "run": "r", "kafka": bad}
        try:
            parse_topology(data)
        except TopologyError as e:
            shown.append(str(e))
    shown += [caplog.text, *capsys.readouterr()]
    assert "kafka security: SASL_SSL, SCRAM-SHA-512, user ops (password from " in shown[0]
    for text in shown:
        assert SECRET not in text and KEY_SECRET not in text
    assert redact(conf)["sasl.password"] == "[redacted]"
