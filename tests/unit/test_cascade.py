"""``digits_cascade`` without Triton: its run function driven by the runtime's driver
(``bls_models.drive``) over stand-in sub-models, its threshold parameter, and the digits models'
deterministic export."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from bls_models import drive
from bls_models import spec as S
from bls_models.cascade import digits_cascade
from bls_models.definition import Setup
from bls_models.params import ConfigError
from bls_models.pipelines import contract_problems


class StandIns:
    """``small`` and ``large`` as a ``drive.drive`` sender, recording each sub-request's rows.

    A row's pixel 0 is the top probability ``small`` gives it and pixel 1 the digit it picks;
    ``large`` picks the next digit with probability 0.97, so every answer says who decided it.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, np.ndarray]] = []

    def __call__(self, sub):
        pixels = sub.inputs[S.DIGIT_PIXELS.name]
        self.calls.append((sub.stage, pixels.copy()))
        assert list(sub.outputs) == [S.DIGIT_PROBS.name]
        top, digit = pixels[:, 0], pixels[:, 1].astype(int)
        if sub.stage == "large":
            top, digit = np.full(len(pixels), 0.97, np.float32), (digit + 1) % 10
        probs = np.repeat(((1 - top) / 9)[:, None], 10, axis=1).astype(np.float32)
        probs[np.arange(len(pixels)), digit] = top
        return {S.DIGIT_PROBS.name: probs}

    def rows(self, stage: str) -> list[np.ndarray]:
        return [pixels for called, pixels in self.calls if called == stage]


def digits_with(top_probs) -> np.ndarray:
    """One row per probability: ``small`` is that sure of digit ``row % 10``."""
    pixels = np.zeros((len(top_probs), 64), np.float32)
    pixels[:, 0] = top_probs
    pixels[:, 1] = np.arange(len(top_probs)) % 10
    return pixels


def run(pixels: np.ndarray, threshold: float, stand_ins: StandIns) -> dict[str, np.ndarray]:
    setup = Setup(options={"threshold": threshold})
    return drive.drive(digits_cascade({S.DIGIT_PIXELS.name: pixels}, drive.Call, setup),
                    stand_ins)


def test_only_the_unsure_rows_go_to_large_in_one_sub_request():
    pixels = digits_with([0.95, 0.5, 0.8, 0.3, 0.99, 0.79])
    stand_ins = StandIns()
    out = run(pixels, 0.8, stand_ins)
    assert [stage for stage, _ in stand_ins.calls] == ["small", "large"]
    np.testing.assert_array_equal(stand_ins.rows("small")[0], pixels)
    unsure = [1, 3, 5]  # 0.8 itself is sure enough: at least the threshold
    np.testing.assert_array_equal(stand_ins.rows("large")[0], pixels[unsure])
    escalated = np.isin(np.arange(6), unsure)
    np.testing.assert_array_equal(out[S.ESCALATED.name][:, 0], escalated)
    np.testing.assert_array_equal(out[S.DIGIT.name][:, 0],
                                  np.where(escalated, np.arange(6) + 1, np.arange(6)))
    np.testing.assert_allclose(out[S.DIGIT_PROB.name][:, 0],
                               np.where(escalated, 0.97, pixels[:, 0]), rtol=1e-6)
    for tensor in S.DIGITS_CASCADE_DEF.outputs:
        value = out[tensor.name]
        assert value.shape == (6, *tensor.dims)
        assert value.dtype == np.dtype(S.DTYPES[tensor.dtype]), tensor.name


def test_no_sub_request_to_large_when_every_row_is_sure():
    stand_ins = StandIns()
    out = run(digits_with([0.9, 0.99, 0.85]), 0.8, stand_ins)
    assert [stage for stage, _ in stand_ins.calls] == ["small"]
    assert not out[S.ESCALATED.name].any()
    np.testing.assert_array_equal(out[S.DIGIT.name][:, 0], [0, 1, 2])


def test_threshold_0_never_escalates():
    stand_ins = StandIns()
    out = run(digits_with([0.1, 0.0, 0.5, 1.0]), 0.0, stand_ins)
    assert [stage for stage, _ in stand_ins.calls] == ["small"]
    assert not out[S.ESCALATED.name].any()


def test_a_threshold_above_1_always_escalates_every_row_at_once():
    pixels = digits_with([1.0, 0.99, 0.5])
    stand_ins = StandIns()
    out = run(pixels, 1.5, stand_ins)
    assert [stage for stage, _ in stand_ins.calls] == ["small", "large"]
    np.testing.assert_array_equal(stand_ins.rows("large")[0], pixels)
    assert out[S.ESCALATED.name].all()
    np.testing.assert_array_equal(out[S.DIGIT.name][:, 0], [1, 2, 3])


def test_digits_cascade_keeps_to_its_contracts():
    assert contract_problems(S.DIGITS_CASCADE_DEF) == []
    assert contract_problems(S.DIGITS_CASCADE_DEF, batch=5) == []


def test_the_threshold_is_a_checked_number():
    definition = S.DIGITS_CASCADE_DEF
    assert definition.parse({}).options["threshold"] == float(S.CASCADE_THRESHOLD.default)
    assert definition.parse({"threshold": "1.5"}).options["threshold"] == 1.5
    for bad in ("x", "-0.1", "nan", "inf"):
        with pytest.raises(ConfigError, match="threshold"):
            definition.parse({"threshold": bad})


def test_the_splits_are_fixed_stratified_and_apart():
    from modelgen import digits

    x_train, x_report, y_train, y_report = digits.split()
    x_valid, y_valid = digits.validation_split()
    again = (*digits.split(), *digits.validation_split())
    for first, second in zip((x_train, x_report, y_train, y_report, x_valid, y_valid), again):
        np.testing.assert_array_equal(first, second)
    assert (len(x_train), len(x_valid), len(x_report)) == (1077, 270, 450)
    assert x_report.dtype == np.float32 and y_report.dtype == np.int64
    assert 0 <= x_report.min() and x_report.max() <= 16
    per_digit = np.bincount(np.concatenate([y_train, y_valid, y_report]))
    assert per_digit.sum() == 1797
    assert np.all(np.abs(np.bincount(y_report) - per_digit / 4) <= 1)  # a quarter of each digit
    assert np.all(np.abs(np.bincount(y_valid) - per_digit * 3 / 20) <= 1)  # a fifth of the rest
    # No image is in two parts (load_digits has a few duplicate images; rows are compared by
    # their index in the data set, recovered from the pixels and label together).
    from sklearn.datasets import load_digits

    data = load_digits()
    index = {(row.astype(np.float32).tobytes(), label): i
             for i, (row, label) in enumerate(zip(data.data, data.target))}
    parts = [{index[(row.tobytes(), label)] for row, label in zip(x, y)}
             for x, y in ((x_train, y_train), (x_valid, y_valid), (x_report, y_report))]
    assert sum(len(part) for part in parts) == len(set().union(*parts))


def test_training_is_deterministic(tmp_path):
    """The same steps of the real networks and plans, twice, uncached: the same bytes."""
    import io

    import torch

    from modelgen import digits

    for name in digits.MODELS:
        weights = []
        for _ in range(2):
            net = digits.build(name, cache=tmp_path, steps=3)
            buffer = io.BytesIO()
            torch.save(net.state_dict(), buffer)
            weights.append(buffer.getvalue())
        assert weights[0] == weights[1], name
        untrained = digits.build(name, cache=tmp_path, steps=0).state_dict()
        assert any(not torch.equal(untrained[k], v) for k, v in net.state_dict().items())
    assert not list(tmp_path.iterdir())  # a partial training is never kept


def test_the_digits_models_export_byte_identical(tmp_path, monkeypatch):
    """Two exports of the same networks: the same bytes. The networks are the seeded, untrained
    ones, not the cached trained ones: `make test` runs the unit tests while the setup is still
    training digits_large, which this test would otherwise train a second time."""
    from modelgen import digits, export

    real = digits.build
    monkeypatch.setattr(digits, "build", lambda name, cache=None, steps=None:
                        real(name, cache=tmp_path / "cache", steps=0))
    digests = {}
    for attempt in ("first", "second"):
        for model in (S.DIGITS_SMALL, S.DIGITS_LARGE):
            path = export.onnx_path(tmp_path / attempt, model)
            export.export_model(model, path, size="small")
            digests.setdefault(model.name, set()).add(hashlib.sha256(path.read_bytes()).hexdigest())
    assert all(len(found) == 1 for found in digests.values()), digests


def test_trained_weights_are_kept_under_what_they_depend_on(tmp_path, monkeypatch):
    """A network is trained once per fingerprint: the second build loads what the first kept."""
    from modelgen import digits

    calls = []
    real = digits._train
    monkeypatch.setattr(digits, "_train", lambda *a, **k: (calls.append(1), real(*a, **k)))
    monkeypatch.setitem(digits.TRAINING, S.DIGITS_SMALL.name,
                        digits.Training(epochs=1, learning_rate=0.01, weight_decay=0.0))
    first = digits.build(S.DIGITS_SMALL.name, cache=tmp_path).state_dict()
    second = digits.build(S.DIGITS_SMALL.name, cache=tmp_path).state_dict()
    assert len(calls) == 1
    assert [p.name for p in tmp_path.iterdir()] == [
        f"{S.DIGITS_SMALL.name}-{digits.fingerprint(S.DIGITS_SMALL.name)}.pt"]
    assert all(np.array_equal(first[k].numpy(), second[k].numpy()) for k in first)
