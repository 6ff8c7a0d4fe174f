"""Model files unpacked from the weight stream (``astraflow.models.archive``): safe on every
Python, including one whose ``tarfile`` has no ``filter="data"`` (Debian 12's 3.11.2)."""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from astraflow.models.archive import UnsafeArchive, extract_model_files
from astraflow.models.share import pack_model_files

REPO = Path(__file__).resolve().parents[3]
ARCHIVE = REPO / "astraflow" / "models" / "archive.py"


def _model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "sub" / "tokenizer.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"weights are not packed")
    return d


def _tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


def test_the_packed_files_come_back_without_the_weights(tmp_path):
    data = pack_model_files(_model_dir(tmp_path))
    out = tmp_path / "out"
    written = extract_model_files(data, out)
    assert sorted(p.relative_to(out).as_posix() for p in written) == [
        "config.json", "sub/tokenizer.json"]
    assert (out / "config.json").read_text() == '{"model_type": "llama"}'
    assert (out / "config.json").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("member,why", [
    ((_member("../evil"), b"x"), "leaves the model directory"),
    ((_member("/etc/evil"), b"x"), "leaves the model directory"),
    ((_member("a/../../evil"), b"x"), "leaves the model directory"),
    ((_member("link", tarfile.SYMTYPE, "/etc/passwd"), None), "not a regular file"),
    ((_member("hard", tarfile.LNKTYPE, "config.json"), None), "not a regular file"),
    ((_member("dev", tarfile.CHRTYPE), None), "not a regular file"),
], ids=["dotdot", "absolute", "nested-dotdot", "symlink", "hardlink", "device"])
def test_an_unsafe_member_refuses_the_whole_archive(tmp_path, member, why):
    data = _tar((_member("config.json"), b"{}"), member)
    out = tmp_path / "out"
    with pytest.raises(UnsafeArchive, match=why):
        extract_model_files(data, out)
    assert not out.exists()  # nothing written
    assert not (tmp_path / "evil").exists()


def _python_without_the_filter() -> str | None:
    """A Python on this machine whose tarfile lacks ``data_filter`` (Debian's own)."""
    for exe in ("/usr/bin/python3", shutil.which("python3.10") or ""):
        if not exe or not Path(exe).exists():
            continue
        probe = subprocess.run([exe, "-c", "import tarfile; print(hasattr(tarfile, "
                                "'data_filter'))"], capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == "False":
            return exe
    return None


def test_it_unpacks_under_a_python_without_the_data_filter(tmp_path):
    """Runs the module itself (it needs the standard library alone) under such a Python:
    the packed files come back, an unsafe archive is refused."""
    exe = _python_without_the_filter()
    if exe is None:
        pytest.skip("no Python without tarfile.data_filter on this machine (Debian 12's "
                    "/usr/bin/python3 is one)")
    good = tmp_path / "good.tar"
    good.write_bytes(pack_model_files(_model_dir(tmp_path)))
    bad = tmp_path / "bad.tar"
    bad.write_bytes(_tar((_member("link", tarfile.SYMTYPE, "/etc/passwd"), None)))
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('archive', {str(ARCHIVE)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        f"print(sorted(p.name for p in m.extract_model_files(open({str(good)!r}, 'rb')"
        f".read(), {str(tmp_path / 'out')!r})))\n"
        "try:\n"
        f"    m.extract_model_files(open({str(bad)!r}, 'rb').read(), {str(tmp_path / 'bad')!r})\n"
        "except m.UnsafeArchive as e:\n"
        "    print('refused:', e)\n")
    run = subprocess.run([exe, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "['config.json', 'tokenizer.json']", run.stdout
    assert lines[1].startswith("refused: model files: refusing member 'link'"), run.stdout
