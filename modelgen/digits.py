"""The two classifiers of ``digits_cascade``, trained on scikit-learn's bundled digits, and the
measurements its threshold is chosen and reported by.

The data is ``sklearn.datasets.load_digits``: 1 797 images of 8x8 pixels valued 0..16, shipped
inside scikit-learn (no download), cut once into three fixed, stratified parts: training (1 077),
validation (270, where the threshold is chosen) and reporting (450, where every figure is
measured). Both networks take the raw pixels (DIGIT_PIXELS) and answer softmax probabilities
(DIGIT_PROBS); the scaling and the softmax are in the graph.

- ``digits_small``: an MLP 64 -> 32 -> 10, the cheap first opinion (microseconds per row),
  trained with label smoothing so that its top probability ranks its doubtful rows well.
- ``digits_large``: a convolutional network over the image scaled up to 48x48 (six 3x3
  convolutions of 64 to 256 channels): it stands for a real large model, with about 340 million
  multiply-adds per row, several milliseconds of one CPU thread (docs/cascade.md has the
  measured figure).

Training is deterministic: fixed seeds, a fixed thread count, deterministic algorithms and a
seeded shuffle, so two trainings on one host give byte-identical weights and exports. The
trained weights are kept in ``CACHE`` under a fingerprint of what they depend on (the code that
splits, builds and trains, the constants and plan, the torch and scikit-learn versions), so
``make models`` trains each network once.

``python -m modelgen.digits`` prints the accuracy of each model alone and of the cascade at a few
thresholds, with the share of rows escalated, on the validation and reporting splits, and the
threshold the validation split chooses (``choose_threshold``), computed in-process by ONNX
Runtime on the exported files.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bls_models import cascade
from bls_models import spec as S
from bls_models.repository import onnx_path

MODELS = (S.DIGITS_SMALL.name, S.DIGITS_LARGE.name)
SEEDS = {S.DIGITS_SMALL.name: 20, S.DIGITS_LARGE.name: 21}
SPLIT_SEED = 0       # the reporting split: a stratified quarter of all images
VALIDATION_SEED = 1  # the validation split: a stratified fifth of the rest
SMALL_HIDDEN = 32  # digits_small's hidden units
PIXEL_MAX = 16.0  # load_digits' pixels are counts 0..16 (4x4 blocks of a 32x32 bitmap)
UPSCALED = 48     # digits_large's input side after bilinear scaling
WIDTH = 64        # digits_large's channels in its first two convolutions (doubled twice)
CACHE = Path(os.environ.get("BLS_DIGITS_CACHE",
                            Path(__file__).resolve().parents[1] / ".cache" / "digits"))


@functools.lru_cache(maxsize=1)
def _parts() -> tuple[np.ndarray, ...]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x, y = data.data.astype(np.float32), data.target.astype(np.int64)
    x_rest, x_report, y_rest, y_report = train_test_split(
        x, y, test_size=0.25, random_state=SPLIT_SEED, stratify=y)
    x_train, x_valid, y_train, y_valid = train_test_split(
        x_rest, y_rest, test_size=0.2, random_state=VALIDATION_SEED, stratify=y_rest)
    return x_train, x_valid, x_report, y_train, y_valid, y_report


def split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, x_report, y_train, y_report): FP32 pixels [N, 64] (0..16) and INT64 labels,
    always the same rows. The reporting split (a stratified quarter) is where every figure is
    measured; neither training nor the threshold's choice sees it. Fresh copies."""
    x_train, _, x_report, y_train, _, y_report = _parts()
    return x_train.copy(), x_report.copy(), y_train.copy(), y_report.copy()


def validation_split() -> tuple[np.ndarray, np.ndarray]:
    """(x_valid, y_valid): the rows the threshold is chosen on, apart from training and
    reporting (a stratified fifth of the non-reporting rows). Fresh copies."""
    _, x_valid, _, _, y_valid, _ = _parts()
    return x_valid.copy(), y_valid.copy()


def _networks():
    import torch
    from torch import nn
    from torch.nn import functional

    class Digits(nn.Module):
        """Raw pixels -> class probabilities; trained through ``logits``."""

        def forward(self, pixels: torch.Tensor) -> torch.Tensor:
            return torch.softmax(self.logits(pixels), dim=-1)

    class Small(Digits):
        """One hidden layer of SMALL_HIDDEN ReLU units."""

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(64, SMALL_HIDDEN), nn.ReLU(),
                                        nn.Linear(SMALL_HIDDEN, 10))

        def logits(self, pixels: torch.Tensor) -> torch.Tensor:
            return self.layers(pixels / PIXEL_MAX)

    def block(inputs: int, outputs: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(inputs, outputs, 3, padding=1, bias=False),
                             nn.BatchNorm2d(outputs), nn.ReLU())

    class Large(Digits):
        """The 8x8 image scaled up to UPSCALED x UPSCALED, three stages of two 3x3
        convolutions (WIDTH, 2 WIDTH, 4 WIDTH channels; max-pooled between stages), global
        average pooling and a linear layer."""

        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(
                block(1, WIDTH), block(WIDTH, WIDTH), nn.MaxPool2d(2),
                block(WIDTH, 2 * WIDTH), block(2 * WIDTH, 2 * WIDTH), nn.MaxPool2d(2),
                block(2 * WIDTH, 4 * WIDTH), block(4 * WIDTH, 4 * WIDTH),
                nn.AdaptiveAvgPool2d(1), nn.Flatten())
            self.head = nn.Linear(4 * WIDTH, 10)

        def logits(self, pixels: torch.Tensor) -> torch.Tensor:
            image = (pixels / PIXEL_MAX).reshape(-1, 1, 8, 8)
            image = functional.interpolate(image, size=(UPSCALED, UPSCALED), mode="bilinear",
                                           align_corners=False)
            return self.head(self.features(image))

    return {S.DIGITS_SMALL.name: Small, S.DIGITS_LARGE.name: Large}


@dataclass(frozen=True)
class Training:
    epochs: int
    learning_rate: float
    weight_decay: float
    batch: int = 64
    # Threads torch trains with: fixed (not the host's count), so the weights are the same on
    # any host with the same torch; a reduction's order depends on it.
    threads: int = 1
    one_cycle: bool = False  # the learning rate warms up and anneals over the run (OneCycleLR)
    label_smoothing: float = 0.0


# The small MLP in a few seconds of one thread; label smoothing keeps its top probability from
# saturating on the rows it gets wrong, so fewer rows need escalating for the same accuracy
# (chosen among five small models on the validation split: docs/journal.md). The CNN with AdamW
# on a one-cycle schedule: 6 epochs of 1 077 images, about 110 s of two threads here; it is
# trained once (``CACHE``).
TRAINING = {S.DIGITS_SMALL.name: Training(epochs=60, learning_rate=0.01, weight_decay=1e-4,
                                          batch=128, label_smoothing=0.1),
            S.DIGITS_LARGE.name: Training(epochs=6, learning_rate=3e-3, weight_decay=1e-4,
                                          batch=64, threads=2, one_cycle=True)}


def fingerprint(name: str) -> str:
    """What ``name``'s trained weights depend on: the code that splits the data, defines the
    networks and trains them, the constants and plan they use, and the torch and scikit-learn
    versions (the data ships with scikit-learn). The module's docstring and the measurement code
    are not part of it: editing them retrains nothing."""
    import inspect

    import sklearn
    import torch

    digest = hashlib.sha256()
    for function in (_parts, _networks, _train, build):
        digest.update(inspect.getsource(function).encode())
    digest.update(repr((name, SEEDS[name], TRAINING[name], SPLIT_SEED, VALIDATION_SEED,
                        SMALL_HIDDEN, PIXEL_MAX, UPSCALED, WIDTH, torch.__version__,
                        sklearn.__version__)).encode())
    return digest.hexdigest()[:16]


def cached(name: str, cache: Path | None = None) -> bool:
    """Whether ``name``'s trained weights are in ``cache`` (default ``CACHE``)."""
    return ((CACHE if cache is None else cache) / f"{name}-{fingerprint(name)}.pt").exists()


def build(name: str, cache: Path | None = None, steps: int | None = None):
    """The trained network behind ONNX model ``name``, in eval mode: the same weights on every
    call on one host. Weights trained before are loaded from ``cache`` (default ``CACHE``; a
    training is stored there); ``steps`` stops training early, uncached (a test's)."""
    import torch

    cache = CACHE if cache is None else cache
    torch.manual_seed(SEEDS[name])
    net = _networks()[name]()
    stored = cache / f"{name}-{fingerprint(name)}.pt"
    if steps is None and stored.exists():
        net.load_state_dict(torch.load(stored, weights_only=True))
        return net.eval()
    plan = TRAINING[name]
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(plan.threads)
    torch.use_deterministic_algorithms(True)
    started = time.monotonic()
    try:
        _train(net, plan, seed=SEEDS[name], steps=steps,
               progress=None if steps is not None else _progress(name, plan.epochs, started))
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    if steps is None:
        print(f"trained {name} in {time.monotonic() - started:.0f} s ({plan.epochs} epochs, "
              f"{plan.threads} threads); kept in {stored}", flush=True)
        stored.parent.mkdir(parents=True, exist_ok=True)
        partial = stored.with_suffix(f".{os.getpid()}.tmp")
        torch.save(net.state_dict(), partial)
        os.replace(partial, stored)
    return net.eval()


def _progress(name: str, epochs: int, started: float, every: float = 10.0):
    """A line per finished epoch, at most one every ``every`` seconds (a long training shows
    it is moving; a short one says nothing until it is done)."""
    said = [started]

    def epoch_done(epoch: int) -> None:
        now = time.monotonic()
        if now - said[0] >= every:
            said[0] = now
            print(f"training {name}: epoch {epoch} of {epochs} done after {now - started:.0f} s",
                  flush=True)
    return epoch_done


def _train(net, plan: Training, seed: int, steps: int | None = None, progress=None) -> None:
    import torch

    x_train, _, y_train, _ = split()
    x, y = torch.from_numpy(x_train), torch.from_numpy(y_train)
    order = torch.Generator().manual_seed(seed)
    optimiser = torch.optim.AdamW(net.parameters(), lr=plan.learning_rate,
                                  weight_decay=plan.weight_decay)
    per_epoch = -(-len(x) // plan.batch)
    schedule = (torch.optim.lr_scheduler.OneCycleLR(optimiser, max_lr=plan.learning_rate,
                                                    total_steps=plan.epochs * per_epoch)
                if plan.one_cycle else None)
    done = 0
    net.train()
    with torch.enable_grad():  # also when built inside a caller's no_grad (a test's, the export's)
        for epoch in range(plan.epochs):
            if progress is not None and epoch:
                progress(epoch)
            for rows in torch.randperm(len(x), generator=order).split(plan.batch):
                if steps is not None and done == steps:
                    return
                optimiser.zero_grad()
                torch.nn.functional.cross_entropy(net.logits(x[rows]), y[rows],
                                                  label_smoothing=plan.label_smoothing).backward()
                optimiser.step()
                if schedule is not None:
                    schedule.step()
                done += 1


def example_input(batch: int = 2):
    """A few reporting rows, to trace the network with at export."""
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


# The thresholds the validation split is searched over, and how close to digits_large alone the
# cascade must be there: the lowest threshold whose cascade loses at most this many points.
CANDIDATES = (*(round(0.5 + 0.01 * i, 2) for i in range(50)), 0.995, 0.999)
TOLERANCE_POINTS = 0.3


def _decided(small: np.ndarray, large: np.ndarray, threshold: float
             ) -> tuple[np.ndarray, np.ndarray]:
    """(digit, escalated) per row of the cascade at ``threshold``, from both models' answers
    for every row (what the served cascade computes, without running ``large`` twice)."""
    digit, prob = cascade.top(small)
    escalated = cascade.escalates(prob, threshold)
    digit[escalated] = cascade.top(large[escalated])[0]
    return digit, escalated


def choose_threshold(models: dict) -> float:
    """The lowest of ``CANDIDATES`` at which the cascade's accuracy on the validation split is
    within ``TOLERANCE_POINTS`` of digits_large alone there (``models``: ``sessions()``). The
    reporting split is not looked at."""
    x_valid, y_valid = validation_split()
    small, large = (probabilities(models[name], x_valid) for name in MODELS)
    goal = 100 * float((cascade.top(large)[0] == y_valid).mean()) - TOLERANCE_POINTS
    for threshold in CANDIDATES:
        if 100 * float((_decided(small, large, threshold)[0] == y_valid).mean()) >= goal - 1e-9:
            return threshold
    return CANDIDATES[-1]


@dataclass(frozen=True)
class Measured:
    what: str            # "digits_small", "digits_large" or "cascade at <threshold>"
    accuracy: float      # on the split measured, 0..1
    escalated: float     # the share of rows sent to digits_large, 0..1


def evaluate(repository: Path, thresholds: tuple[float, ...] = (0.5, 0.8, 0.95),
             part: str = "reporting") -> list[Measured]:
    """Accuracy on ``part`` ("reporting" or "validation") of each model alone and of the
    cascade at ``thresholds``, with the share of rows escalated, in-process on
    ``repository``'s exported files."""
    x, y = validation_split() if part == "validation" else split()[1::2]
    models = sessions(repository)
    small, large = (probabilities(models[name], x) for name in MODELS)
    measured = [Measured(S.DIGITS_SMALL.name, float((cascade.top(small)[0] == y).mean()), 0.0),
                Measured(S.DIGITS_LARGE.name, float((cascade.top(large)[0] == y).mean()), 1.0)]
    for threshold in thresholds:
        digit, escalated = _decided(small, large, threshold)
        measured.append(Measured(f"cascade at {threshold:g}", float((digit == y).mean()),
                                 float(escalated.mean())))
    return measured


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The digits models and the cascade, measured "
                                                 "on the validation and reporting splits.")
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--thresholds", type=float, nargs="+",
                        default=[0.5, float(S.CASCADE_THRESHOLD.default), 0.95])
    args = parser.parse_args(argv)
    chosen = choose_threshold(sessions(args.repository))
    thresholds = tuple(dict.fromkeys([*args.thresholds, chosen]))
    for part in ("validation", "reporting"):
        print(f"{part + ' split':<22} {'accuracy':>9} {'escalated':>10}")
        for row in evaluate(args.repository, thresholds, part):
            print(f"{row.what:<22} {100 * row.accuracy:>8.2f}% {100 * row.escalated:>9.1f}%")
    print(f"threshold chosen on the validation split: {chosen:g} (committed: "
          f"{S.CASCADE_THRESHOLD.default})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
