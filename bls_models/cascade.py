"""``digits_cascade``: each digit answered by the cheap model when it is sure enough, else by the
large one.

A run function (docs/extending.md), with no Triton in it. Every row goes to stage ``small`` in
one sub-request. A row whose top probability reaches the pipeline's ``threshold`` parameter is
answered from ``small``; the other rows, and only they, go to stage ``large`` in one more
sub-request (none when every row is answered). Each row's DIGIT and DIGIT_PROB are the argmax and
its probability from the model that decided it, and ESCALATED says whether that was ``large``.
A threshold of 0 never escalates; one above 1 always does.
"""

from __future__ import annotations

import numpy as np

from bls_models import spec as S
from bls_models.definition import Setup


def top(probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the most probable class (INT64; ties go to the lower id) and its probability."""
    digits = probs.argmax(axis=1)
    return digits.astype(np.int64), np.take_along_axis(probs, digits[:, None], 1)[:, 0]


def escalates(top_probs: np.ndarray, threshold: float) -> np.ndarray:
    """The rows ``small`` did not decide: their top probability is below ``threshold``."""
    return ~(top_probs >= threshold)  # a NaN probability escalates too


async def digits_cascade(inputs: dict[str, np.ndarray], call, setup: Setup = Setup()
                         ) -> dict[str, np.ndarray]:
    """DIGIT_PIXELS -> small -> (the unsure rows) -> large -> DIGIT, DIGIT_PROB, ESCALATED."""
    pixels = inputs[S.DIGIT_PIXELS.name]
    small = await call("small", {S.DIGIT_PIXELS.name: pixels}, [S.DIGIT_PROBS.name])
    digit, prob = top(small[S.DIGIT_PROBS.name])
    escalated = escalates(prob, setup.options["threshold"])
    unsure = np.flatnonzero(escalated)
    if unsure.size:
        large = await call("large", {S.DIGIT_PIXELS.name: pixels[unsure]}, [S.DIGIT_PROBS.name])
        digit[unsure], prob[unsure] = top(large[S.DIGIT_PROBS.name])
    return {S.DIGIT.name: digit[:, None], S.DIGIT_PROB.name: prob.astype(np.float32)[:, None],
            S.ESCALATED.name: escalated[:, None]}
