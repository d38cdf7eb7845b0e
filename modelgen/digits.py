"""The two classifiers of ``digits_cascade``, trained on scikit-learn's bundled digits, and the
held-out measurement its threshold was chosen by.

The data is ``sklearn.datasets.load_digits``: 1 797 images of 8x8 pixels valued 0..16, shipped
inside scikit-learn (no download). ``split()`` is the one train/held-out split, the same for
training, the measurement and the tests. Both networks take the raw pixels (DIGIT_PIXELS) and
answer softmax probabilities (DIGIT_PROBS); the scaling and the softmax are in the graph.

- ``digits_small``: one linear layer, the cheap first opinion.
- ``digits_large``: an MLP 64 -> 256 -> 256 -> 10, about 130 times the multiply-adds, more
  accurate.

Training is deterministic: fixed seeds, one thread, deterministic algorithms and a seeded
shuffle, so two exports on one host write byte-identical files (``modelgen.export`` builds
them through ``nets.build``).

``python -m modelgen.digits`` prints the accuracy of each model alone and of the cascade at a few
thresholds, with the share of rows escalated, on the held-out split, computed in-process by ONNX
Runtime on the exported files (``evaluate``; docs/cascade.md has the committed figures).
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bls_models import cascade
from bls_models import spec as S
from bls_models.repository import onnx_path

MODELS = (S.DIGITS_SMALL.name, S.DIGITS_LARGE.name)
SEEDS = {S.DIGITS_SMALL.name: 20, S.DIGITS_LARGE.name: 21}
SPLIT_SEED = 0
HIDDEN = 256  # digits_large's hidden units per layer
PIXEL_MAX = 16.0  # load_digits' pixels are counts 0..16 (4x4 blocks of a 32x32 bitmap)


@functools.lru_cache(maxsize=1)
def _split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x, y = data.data.astype(np.float32), data.target.astype(np.int64)
    return tuple(train_test_split(x, y, test_size=0.25, random_state=SPLIT_SEED, stratify=y))


def split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, x_test, y_train, y_test): FP32 pixels [N, 64] (0..16) and INT64 labels, always
    the same rows (a stratified quarter held out). Fresh copies: callers may write to them."""
    return tuple(part.copy() for part in _split())


def _networks():
    import torch
    from torch import nn

    class Digits(nn.Module):
        """Raw pixels -> class probabilities; trained through ``logits``."""

        def forward(self, pixels: torch.Tensor) -> torch.Tensor:
            return torch.softmax(self.logits(pixels), dim=-1)

    class Small(Digits):
        """One linear layer (multinomial logistic regression)."""

        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(64, 10)

        def logits(self, pixels: torch.Tensor) -> torch.Tensor:
            return self.linear(pixels / PIXEL_MAX)

    class Large(Digits):
        """Two hidden layers of HIDDEN ReLU units."""

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(64, HIDDEN), nn.ReLU(),
                                        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                                        nn.Linear(HIDDEN, 10))

        def logits(self, pixels: torch.Tensor) -> torch.Tensor:
            return self.layers(pixels / PIXEL_MAX)

    return {S.DIGITS_SMALL.name: Small, S.DIGITS_LARGE.name: Large}


@dataclass(frozen=True)
class Training:
    epochs: int
    learning_rate: float
    weight_decay: float
    batch: int = 64


# Sized so that both train in a few seconds on one thread: the linear model in large cheap
# batches at a high rate, the MLP in smaller ones, with a little weight decay against overfitting
# 1 347 images.
TRAINING = {S.DIGITS_SMALL.name: Training(epochs=60, learning_rate=0.05, weight_decay=1e-4,
                                          batch=256),
            S.DIGITS_LARGE.name: Training(epochs=40, learning_rate=1e-3, weight_decay=1e-4,
                                          batch=128)}


def build(name: str):
    """The trained network behind ONNX model ``name``, in eval mode: the same weights on every
    call on one host."""
    import torch

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    # One thread: a multi-threaded reduction may sum in another order from run to run.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(SEEDS[name])
        net = _networks()[name]()
        _train(net, TRAINING[name], seed=SEEDS[name])
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    return net.eval()


def _train(net, plan: Training, seed: int) -> None:
    import torch

    x_train, _, y_train, _ = split()
    x, y = torch.from_numpy(x_train), torch.from_numpy(y_train)
    order = torch.Generator().manual_seed(seed)
    optimiser = torch.optim.Adam(net.parameters(), lr=plan.learning_rate,
                                 weight_decay=plan.weight_decay)
    net.train()
    with torch.enable_grad():  # also when built inside a caller's no_grad (a test's, the export's)
        for _ in range(plan.epochs):
            for rows in torch.randperm(len(x), generator=order).split(plan.batch):
                optimiser.zero_grad()
                torch.nn.functional.cross_entropy(net.logits(x[rows]), y[rows]).backward()
                optimiser.step()


def example_input(batch: int = 2):
    """A few held-out rows, to trace the network with at export."""
    import torch

    return torch.from_numpy(split()[1][:batch])


# -- the measurement -------------------------------------------------------------------------
def sessions(repository: Path) -> dict:
    """An ONNX Runtime session per digits model over ``repository``'s exported files, one
    thread each (as served: ``ORT_CPU_PARAMETERS``)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return {name: ort.InferenceSession(str(onnx_path(repository, S.model(name))),
                                       options, providers=["CPUExecutionProvider"])
            for name in MODELS}


def probabilities(session, pixels: np.ndarray) -> np.ndarray:
    return session.run([S.DIGIT_PROBS.name], {S.DIGIT_PIXELS.name: pixels})[0]


def in_process_cascade(models: dict, pixels: np.ndarray, threshold: float
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What ``digits_cascade`` answers for ``pixels`` (DIGIT, DIGIT_PROB, ESCALATED per row),
    computed here: ``models`` are ``sessions()``."""
    digit, prob = cascade.top(probabilities(models[S.DIGITS_SMALL.name], pixels))
    escalated = cascade.escalates(prob, threshold)
    if escalated.any():
        large = probabilities(models[S.DIGITS_LARGE.name], pixels[escalated])
        digit[escalated], prob[escalated] = cascade.top(large)
    return digit, prob, escalated


@dataclass(frozen=True)
class Measured:
    what: str            # "digits_small", "digits_large" or "cascade at <threshold>"
    accuracy: float      # on the held-out split, 0..1
    escalated: float     # the share of rows sent to digits_large, 0..1


def evaluate(repository: Path, thresholds: tuple[float, ...] = (0.5, 0.8, 0.95)
             ) -> list[Measured]:
    """Accuracy on the held-out split of each model alone and of the cascade at ``thresholds``,
    with the share of rows escalated, in-process on ``repository``'s exported files."""
    _, x_test, _, y_test = split()
    models = sessions(repository)
    measured = [Measured(name, float((cascade.top(probabilities(models[name], x_test))[0]
                                      == y_test).mean()), float(name == S.DIGITS_LARGE.name))
                for name in MODELS]
    for threshold in thresholds:
        digit, _, escalated = in_process_cascade(models, x_test, threshold)
        measured.append(Measured(f"cascade at {threshold:g}", float((digit == y_test).mean()),
                                 float(escalated.mean())))
    return measured


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The digits models and the cascade, measured "
                                                 "on the held-out split.")
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--thresholds", type=float, nargs="+",
                        default=[0.5, float(S.CASCADE_THRESHOLD.default), 0.95])
    args = parser.parse_args(argv)
    print(f"{'':<22} {'accuracy':>9} {'escalated':>10}")
    for row in evaluate(args.repository, tuple(args.thresholds)):
        print(f"{row.what:<22} {100 * row.accuracy:>8.2f}% {100 * row.escalated:>9.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
