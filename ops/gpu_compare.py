"""How a GPU answer is compared with CPU ONNX Runtime's on the same ONNX file (``make gpu-check``):
the tolerances per profile and the comparisons. Pure numpy, imported only when used: this module
loads with the standard library alone."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    """How far a GPU answer may be from CPU ONNX Runtime's (FP32) on the same ONNX file.

    * ``probs``: |served CLASS_PROBS / TAG_PROBS - CPU probability of the same class|.
    * ``tie``: top-5 ids (and each token's tag) must equal the CPU's, except where the two
      classes' CPU probabilities differ by at most ``tie``: a near-tie the GPU arithmetic may
      order either way (a "flip", counted in the report, not a failure).
    * ``embedding``: cosine similarity of EMBEDDING (L2-normalised) to the CPU's, at least.
    """

    arithmetic: str
    probs: float
    tie: float
    embedding: float


# ONNX Runtime's CUDA provider runs FP32 convolutions and matmuls in TF32 on Ampere and newer
# (its `use_tf32` default): 10 mantissa bits, ~5e-4 relative per product, accumulated over ~50
# layers. TensorRT's FP16 (gpu-ort-trt, gpu-trt) has the same mantissa and a narrower range, and
# FP16 accumulation in places. First estimates, to be confirmed by the first GPU run (the report
# prints the largest differences seen, so they can be tightened).
TOLERANCES = {
    "gpu": Tolerance("FP32 (TF32 on Ampere+)", probs=5e-3, tie=1e-2, embedding=0.999),
    "gpu-ort-trt": Tolerance("FP16 (TensorRT)", probs=2e-2, tie=4e-2, embedding=0.99),
    "gpu-trt": Tolerance("FP16 (TensorRT)", probs=2e-2, tie=4e-2, embedding=0.99),
}



def softmax(logits):
    import numpy as np

    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=-1, keepdims=True)


def compare_top_k(reference, ids, probs, tolerance: Tolerance) -> tuple[list[str], int, float]:
    """One image's served top-k (``ids``, ``probs``) against the CPU's probabilities over every
    class (``reference``): (problems, near-tie flips, largest probability difference)."""
    import numpy as np

    expected = np.argsort(-reference, kind="stable")[: len(ids)]
    problems, flips = [], 0
    difference = float(np.max(np.abs(probs - reference[ids])))
    if difference > tolerance.probs:
        problems.append(f"probabilities differ by {difference:.2g} > {tolerance.probs:g}")
    for rank, (served, wanted) in enumerate(zip(ids, expected)):
        if served == wanted:
            continue
        gap = abs(float(reference[served] - reference[wanted]))
        if gap <= tolerance.tie:
            flips += 1
        else:
            problems.append(f"rank {rank + 1}: class {served} instead of {wanted} (CPU "
                            f"probabilities {reference[served]:.4f} vs {reference[wanted]:.4f})")
    return problems, flips, difference


def compare_tags(reference, tags, tag_probs, tolerance: Tolerance) -> tuple[list[str], int, float]:
    """One sequence's TAGS and TAG_PROBS against the CPU's per-token probabilities (``reference``,
    [tokens, vocabulary]), with the same rules as ``compare_top_k`` for rank 1."""
    import numpy as np

    rows = np.arange(len(tags))
    wanted = reference.argmax(axis=-1)
    gaps = np.abs(reference[rows, tags] - reference[rows, wanted])
    difference = float(np.max(np.abs(tag_probs - reference[rows, tags])))
    problems = []
    if difference > tolerance.probs:
        problems.append(f"tag probabilities differ by {difference:.2g} > {tolerance.probs:g}")
    wrong = np.flatnonzero((tags != wanted) & (gaps > tolerance.tie))
    if wrong.size:
        problems.append(f"{wrong.size} token(s) tagged differently, e.g. token {wrong[0]}: "
                        f"{tags[wrong[0]]} instead of {wanted[wrong[0]]}")
    return problems, int(((tags != wanted) & (gaps <= tolerance.tie)).sum()), difference


def cosine(a, b) -> float:
    import numpy as np

    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def flat(samples: list[float], allowed: float) -> tuple[bool, float]:
    """Whether a series stayed flat: the mean of its last third exceeds the mean of its first
    third by at most ``allowed`` (the growth, returned too)."""
    third = max(1, len(samples) // 3)
    growth = sum(samples[-third:]) / third - sum(samples[:third]) / third
    return growth <= allowed, growth

