"""The models the benchmark serves beside the committed repository (``build_variants``): variants
of committed models, the anchors and the concurrency designs; and what the test suite serves
beside it (``build_test_repository``: the same plus the fault models and the test variants).
Both write into a directory of their own; the committed repository is only read.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from bench import anchors, clients, control_flow, designs
from bls_models import spec as S
from modelgen import export, variants

LONG_DEADLINE_PIPELINE = "pipeline_deadline_120s"
LOGITS_TAG_PIPELINE = "tag_pipeline_logits"  # tag_pipeline over `tagger`: reduced in the stub
# `pipeline` admitting what this machine answers within about a second (~70 req/s): 2 instances
# each running one batch of up to 16 and a queue of 32 in Triton (its queue policy's
# max_queue_size), 64 in all, against the committed 2 x 16 and a queue of 4 096. Beyond that
# Triton refuses at once ("Exceeds maximum queue size").
SHEDDING_PIPELINE = "pipeline_shed"


def variant_specs(repository: Path) -> list[tuple[S.ModelSpec, str]]:
    """(spec, base) pairs: base is the committed model whose code or ONNX file the variant uses."""
    # perf_analyzer cannot give a request a timeout, so at 1 000 in flight it gets the default
    # deadline (10 s); this variant gives it the budget the project's clients set per request.
    budget = dataclasses.replace(S.PIPELINE, name=LONG_DEADLINE_PIPELINE,
                                 parameters={**S.PIPELINE.parameters,
                                             "default_deadline_ms": str(clients.BUDGET_US // 1000),
                                             "stage_model_repositories": str(repository)})
    taggers = [dataclasses.replace(S.TAGGER, name=f"tagger_delay_{label}",
                                   batching=dataclasses.replace(S.TAGGER.batching,
                                                                max_queue_delay_us=delay))
               for label, delay in (("100ms", 100_000), ("100us", 100))]
    logits = dataclasses.replace(S.TAG_PIPELINE, name=LOGITS_TAG_PIPELINE,
                                 parameters={**S.TAG_PIPELINE.parameters, "tagger_model": "tagger",
                                             "stage_model_repositories": str(repository)})
    shedding = dataclasses.replace(
        S.PIPELINE, name=SHEDDING_PIPELINE,
        parameters={**S.PIPELINE.parameters, "stage_model_repositories": str(repository)},
        batching=dataclasses.replace(S.PIPELINE.batching, max_queue_size=32))
    return ([(budget, "pipeline"), (logits, "tag_pipeline"), (shedding, "pipeline")]
            + [(t, "tagger") for t in taggers]
            + [(c, S.DIGITS_CASCADE.name) for c in control_flow.cascade_variants(repository)])


def build_variants(target: Path, repository: Path) -> Path:
    """Fault models (the designs use them) and the benchmark variants, in ``target``."""
    variants.build(target, repository, variants=())
    return write_variants(target, repository)


def build_test_repository(target: Path, repository: Path) -> Path:
    """What the test suite serves beside ``repository``, in ``target`` (a fresh directory): the
    fault models, the test variants and the benchmark variants (tests/conftest.py,
    scripts/container-test.sh)."""
    variants.build(target, repository)
    return write_variants(target, repository)


def write_variants(target: Path, repository: Path) -> Path:
    for spec, base in variant_specs(repository):
        if spec.backend == "onnxruntime":
            variants.write_onnx(target, spec, export.onnx_path(repository, S.model(base)))
        else:
            variants.write(target, spec)
    # The runtime's measuring sticks (bench/anchors.py): the anchor, the sequential fan-out and
    # the concurrency designs.
    anchors.write(target, anchors.like_pipeline("pipeline_minimal",
                                                stage_model_repositories=str(repository)),
                  anchors.MINIMAL)
    anchors.write(target, dataclasses.replace(
        anchors.SEQUENTIAL.model_spec(), parameters={
            **anchors.SEQUENTIAL.model_spec().parameters,
            "stage_model_repositories": str(repository)}), anchors.SEQUENTIAL_MODEL_PY)
    designs.write_designs(target, repository)
    return target
