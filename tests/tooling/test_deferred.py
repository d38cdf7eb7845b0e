"""What ``make serve`` serves later (tritonlocal.deferred): the models that need a deferred one,
read from the committed configs, and the server flags that leave them out of the start."""

from __future__ import annotations

import shutil
from pathlib import Path

from bls_models import spec as S
from tritonlocal import ServerOptions, TritonServer, deferred, flags

ROOT = Path(__file__).resolve().parents[2]
REPOSITORY = ROOT / "model_repository"


def test_the_models_needing_digits_large_are_the_cascade_and_its_ensemble():
    assert deferred.dependents(REPOSITORY, {S.DIGITS_LARGE.name}) == {
        S.DIGITS_CASCADE.name, "digits_ensemble"}
    # Through a stage of a stage: every model needing preprocess, directly or not.
    assert deferred.dependents(REPOSITORY, {S.PREPROCESS.name}) == {
        S.PIPELINE.name, S.PIPELINE_ENSEMBLE.name}


def test_a_missing_model_file_is_pending_with_what_needs_it(tmp_path):
    for config in REPOSITORY.glob("*/config.pbtxt"):
        target = tmp_path / config.parent.name
        shutil.copytree(config.parent, target, ignore=shutil.ignore_patterns("*.onnx"))
        (target / "1").mkdir(exist_ok=True)
        if config.parent.name != S.DIGITS_LARGE.name:
            (target / "1" / "model.onnx").write_bytes(b"")
    assert deferred.pending(tmp_path) == ([S.DIGITS_LARGE.name],
                                          sorted([S.DIGITS_CASCADE.name, "digits_ensemble"]))
    (tmp_path / S.DIGITS_LARGE.name / "1" / "model.onnx").write_bytes(b"")
    assert deferred.pending(tmp_path) == ([], [])


def test_a_server_with_deferred_models_loads_each_other_model_by_name(tmp_path):
    assert "--load-model=*" in flags.serving_flags()
    options = ServerOptions(REPOSITORY, deferred=frozenset({"digits_large", "digits_cascade"}))
    command = TritonServer(options).command(Path("tritonserver"), REPOSITORY, tmp_path, [])
    loaded = {arg.split("=", 1)[1] for arg in command if arg.startswith("--load-model=")}
    served = {p.parent.name for p in REPOSITORY.glob("*/config.pbtxt")}
    assert loaded == served - {"digits_large", "digits_cascade"}


def test_the_export_defers_an_untrained_model_and_makes_only_it_later(tmp_path, monkeypatch):
    from modelgen import export

    made = []

    def fake_export(model, path, size):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"{model.name} {size}".encode())
        made.append(model.name)

    monkeypatch.setattr(export, "export_model", fake_export)
    monkeypatch.setattr(export, "fingerprint", lambda size: f"fp-{size}")
    monkeypatch.setattr(export, "_trained", lambda name: name != S.DIGITS_LARGE.name)
    everything = [m.name for m in S.ONNX_MODELS]
    large = export.onnx_path(tmp_path, S.DIGITS_LARGE)

    assert export.export_all(tmp_path, "small", defer=(S.DIGITS_LARGE.name,)) == [
        name for name in everything if name != S.DIGITS_LARGE.name]
    assert not large.exists()
    made.clear()
    assert export.export_all(tmp_path, "small") == [S.DIGITS_LARGE.name]  # only what is missing
    assert made == [S.DIGITS_LARGE.name] and large.exists()
    assert export.export_all(tmp_path, "small") == []
    # A new fingerprint: all again, and a deferred model's stale file goes.
    assert S.DIGITS_LARGE.name not in export.export_all(tmp_path, "full",
                                                        defer=(S.DIGITS_LARGE.name,))
    assert not large.exists()
