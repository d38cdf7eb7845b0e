"""The export writes only into the project's own repository, and never over a model file the
project did not write; a repository the user gives is served as it is (modelgen/export.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from bls_models import spec as S
from modelgen import export

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def quick_export(monkeypatch):
    """export_model and the fingerprint without torch: a file naming its model."""
    written = []

    def fake_export(model, path, size):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"exported {model.name} {size}".encode())
        written.append(path)

    monkeypatch.setattr(export, "export_model", fake_export)
    monkeypatch.setattr(export, "fingerprint", lambda size: f"fingerprint-{size}")
    return written


def snapshot(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def user_copy(tmp_path: Path, with_files: bool) -> Path:
    """The project's repository as a user would copy it (configs and code), with the user's own
    model.onnx for every onnxruntime model when ``with_files``."""
    copy = tmp_path / "their_repository"
    shutil.copytree(ROOT / "model_repository", copy,
                    ignore=shutil.ignore_patterns("*.onnx", "*.plan", "__pycache__", ".export*"))
    if with_files:
        for model in S.ONNX_MODELS:
            if (copy / model.name / "config.pbtxt").exists():
                path = copy / model.name / "1" / "model.onnx"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(f"the user's own {model.name}".encode())
    return copy


def test_a_model_file_the_project_did_not_write_is_never_overwritten(tmp_path, quick_export):
    theirs = export.onnx_path(tmp_path, S.CLASSIFIER)
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(b"not the project's")
    for force in (False, True):
        with pytest.raises(export.ForeignModelFile, match="classifier"):
            export.export_all(tmp_path, "small", force=force)
    assert theirs.read_bytes() == b"not the project's" and quick_export == []


def test_a_file_replaced_after_an_export_is_left_alone_and_the_projects_own_are_renewed(
        tmp_path, quick_export):
    assert export.export_all(tmp_path, "small") != []
    stamp = json.loads((tmp_path / export.STAMP).read_text())
    assert set(stamp["files"]) == {m.name for m in S.ONNX_MODELS}
    # The project's own files are renewed when the export changes ...
    assert export.export_all(tmp_path, "full") != []
    # ... a file someone put there instead is not.
    replaced = export.onnx_path(tmp_path, S.EMBEDDER)
    replaced.write_bytes(b"someone's embedder")
    with pytest.raises(export.ForeignModelFile, match="embedder"):
        export.export_all(tmp_path, "small")
    assert replaced.read_bytes() == b"someone's embedder"


def test_a_given_repository_with_its_own_model_files_is_not_written_to(tmp_path, quick_export,
                                                                       capsys):
    copy = user_copy(tmp_path, with_files=True)
    before = snapshot(copy)
    assert export.main(["--repository", str(copy)]) == 0
    assert snapshot(copy) == before and quick_export == []
    assert "served as it is" in capsys.readouterr().out


def test_a_given_repository_missing_a_model_file_stops_with_one_line(tmp_path, quick_export,
                                                                     capsys):
    copy = user_copy(tmp_path, with_files=True)
    (copy / "embedder" / "1" / "model.onnx").unlink()
    before = snapshot(copy)
    assert export.main(["--repository", str(copy)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert str(copy / "embedder" / "1" / "model.onnx") in err and "EXPORT_INTO_GIVEN" in err
    assert snapshot(copy) == before and quick_export == []


def test_the_opt_in_exports_only_the_missing_files_of_the_projects_models(tmp_path, quick_export):
    copy = user_copy(tmp_path, with_files=True)
    missing = copy / "embedder" / "1" / "model.onnx"
    missing.unlink()
    before = snapshot(copy)
    assert export.main(["--repository", str(copy), "--into-given"]) == 0
    assert quick_export == [missing]
    after = snapshot(copy)
    assert {k: v for k, v in after.items() if k != "embedder/1/model.onnx"} == before
    assert not (copy / export.STAMP).exists()
