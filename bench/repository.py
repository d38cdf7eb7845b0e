"""The models the benchmark serves beside the committed repository (``build_variants``): variants
of committed models and the anchor; and what the test suite serves beside it
(``build_test_repository``: the same plus the fault models and the test variants). Both write
into a directory of their own; the committed repository is only read.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from bench import anchors, control_flow
from bls_models import spec as S
from modelgen import export, variants

LOGITS_TAG_PIPELINE = "tag_pipeline_logits"  # tag_pipeline over `tagger`: reduced in the stub
# `pipeline` admitting what this machine answers within about a second (~70 req/s): 2 instances
# each running one batch of up to 16 and a queue of 32 in Triton (its queue policy's
# max_queue_size), 64 in all, against the committed 2 x 16 and a queue of 4 096. Beyond that
# Triton refuses at once ("Exceeds maximum queue size").
SHEDDING_PIPELINE = "pipeline_shed"


def variant_specs(repository: Path) -> list[tuple[S.ModelSpec, str]]:
    """(spec, base) pairs: base is the committed model whose code or ONNX file the variant uses."""
    logits = dataclasses.replace(S.TAG_PIPELINE, name=LOGITS_TAG_PIPELINE,
                                 parameters={**S.TAG_PIPELINE.parameters, "tagger_model": "tagger",
                                             "stage_model_repositories": str(repository)})
    shedding = dataclasses.replace(
        S.PIPELINE, name=SHEDDING_PIPELINE,
        parameters={**S.PIPELINE.parameters, "stage_model_repositories": str(repository)},
        batching=dataclasses.replace(S.PIPELINE.batching, max_queue_size=32))
    return ([(logits, "tag_pipeline"), (shedding, "pipeline")]
            + [(c, S.DIGITS_CASCADE.name) for c in control_flow.cascade_variants(repository)])


def build_variants(target: Path, repository: Path) -> Path:
    """The benchmark variants and the anchor, in ``target``."""
    for spec, base in variant_specs(repository):
        if spec.backend == "onnxruntime":
            variants.write_onnx(target, spec, export.onnx_path(repository, S.model(base)))
        else:
            variants.write(target, spec)
    anchors.write(target, repository)
    return target


def build_test_repository(target: Path, repository: Path) -> Path:
    """What the test suite serves beside ``repository``, in ``target`` (a fresh directory): the
    fault models, the test variants and the benchmark variants (tests/conftest.py,
    scripts/container-test.sh)."""
    variants.build(target, repository)
    return build_variants(target, repository)
