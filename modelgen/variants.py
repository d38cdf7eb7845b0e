"""Repositories of variants: fault models and orchestrators wired to them, for tests and benchmarks.

Served next to the real `model_repository/` (tritonserver takes several repositories), so the
real models run exactly as committed. Configs are rendered from specs like the real ones; the
fault model's code is `modelgen/fault_model.py`. Nothing here is part of the production repository.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from bls_models import spec as S
from bls_models.definition import QUEUED_BLS_BATCHING
from modelgen import configs, poison

FAULT_MODEL = Path(__file__).with_name("fault_model.py")

_FAST_QUEUE = S.BatchingSpec(preferred_batch_sizes=(), max_queue_delay_us=0)
# A queue policy (none in the committed configs): where a test needs Triton's queue errors.
_QUEUED = S.BatchingSpec(preferred_batch_sizes=(), max_queue_delay_us=0,
                         queue_timeout_us=10_000_000, max_queue_size=64)


def fault_model(name: str, stand_in_for: S.ModelSpec, instances: int = 4,
                batching: S.BatchingSpec = _FAST_QUEUE) -> S.ModelSpec:
    return dataclasses.replace(stand_in_for, name=name, backend="python", kind="KIND_CPU",
                               instance_count=instances, batching=batching,
                               description=f"fault stand-in for {stand_in_for.name}")


FAULT_MODELS = (
    fault_model("fault_preprocess", S.PREPROCESS),
    fault_model("fault_classifier", S.CLASSIFIER),
    fault_model("fault_embedder", S.EMBEDDER),
    fault_model("fault_tagger", S.TAGGER),
    # One instance, a queue of 2: the fourth concurrent request is refused ("queue full"). A
    # batch of 1: an orchestrator over it runs each request as a group of its own.
    dataclasses.replace(fault_model("fault_queue", S.CLASSIFIER, instances=1,
                                    batching=dataclasses.replace(_QUEUED, max_queue_size=2)),
                        max_batch_size=1),
    # Killed by the crash test; nothing else uses it.
    fault_model("fault_crash", S.CLASSIFIER, instances=1),
    # Made slow for a while, then recovered, by the degradation test (its slow_ms file).
    fault_model("fault_slow", S.CLASSIFIER),
    # Made to fail every request for a while by the sick-stage test (its error file).
    fault_model("fault_sick", S.EMBEDDER, instances=2),
    # Slow for one request while it serves the others: a parked request is answered later
    # through its sender (tests/live/test_head_of_line.py).
    fault_model("fault_park", S.CLASSIFIER, instances=2),
    # The same with a batch of 1: an orchestrator over it runs each request as a group of its
    # own, so one execute holds several groups (tests/live/test_head_of_line.py).
    dataclasses.replace(fault_model("fault_park_single", S.CLASSIFIER, instances=1),
                        max_batch_size=1),
)


# An ONNX model with the classifier's contract that fails its whole batch when one item is
# poisoned (modelgen/poison.py), on Triton's onnxruntime backend. One instance and a 200 ms
# batching delay with a preferred size of 4: four requests sent together run as one batch.
# KIND_CPU also in the container: ONNX Runtime's CPU Gather checks its indices (its CUDA
# kernel's behaviour on an out-of-range index is not what this model is about).
FAULT_BATCH = dataclasses.replace(
    S.CLASSIFIER, name="fault_batch", instance_count=1, kind="KIND_CPU",
    batching=S.BatchingSpec(preferred_batch_sizes=(4,), max_queue_delay_us=200_000),
    description="classifier contract; ONNX Runtime fails the whole batch if an item is poisoned")
# The same with the embedder's contract and the committed embedder's batching and instances: a
# batch-failing model in the embedder stage, batching as the real one does.
FAULT_BATCH_EMBEDDER = dataclasses.replace(
    S.EMBEDDER, name="fault_batch_embedder", kind="KIND_CPU",
    description="embedder contract; ONNX Runtime fails the whole batch if an item is poisoned")
POISONED_MODELS = ((FAULT_BATCH, S.CLASS_LOGITS), (FAULT_BATCH_EMBEDDER, S.EMBEDDING))


# The real classifier with one instance and a queue of 1, and one with a queue of 64: kept busy
# by a test, a BLS sub-request to them is refused (queue full) or expires in the queue (timeout).
CONTENDED = (
    dataclasses.replace(S.CLASSIFIER, name="classifier_queue1", instance_count=1,
                        batching=dataclasses.replace(_QUEUED, max_queue_size=1)),
    dataclasses.replace(S.CLASSIFIER, name="classifier_queue64", instance_count=1,
                        batching=_QUEUED),
)
PROBE_MODEL = Path(__file__).with_name("probe_model.py")
PROBE = S.ModelSpec(
    name="bls_probe", backend="python", kind="KIND_CPU", instance_count=1, max_batch_size=0,
    batching=None, inputs=(S.TensorSpec("SPEC", "TYPE_STRING", (1,)),),
    outputs=(S.TensorSpec("MESSAGE", "TYPE_STRING", (1,)),
             S.TensorSpec("MEMORY", "TYPE_STRING", (1,))),
    description="sends one BLS sub-request and answers its error message and where its outputs "
                "are (modelgen/probe_model.py)")


def variant(base: S.ModelSpec, name: str, **parameters: str) -> S.ModelSpec:
    return dataclasses.replace(base, name=name, parameters={**base.parameters, **parameters})


VARIANTS = (
    variant(S.PIPELINE, "pipeline_faulty", preprocess_model="fault_preprocess",
            classifier_model="fault_classifier", embedder_model="fault_embedder",
            embedder_timeout_ms="400", default_deadline_ms="1500"),
    variant(S.TAG_PIPELINE, "tag_pipeline_faulty", tagger_model="fault_tagger",
            default_deadline_ms="1500"),
    # One request per execute and an instance for each of the queue test's 8 requests: an
    # instance runs one batch at a time, so only instances send concurrent sub-requests enough
    # to fill fault_queue, and a refused request, alone in its execute, is answered at once
    # (tests/live/test_orchestrator.py).
    dataclasses.replace(variant(S.PIPELINE, "pipeline_queue", preprocess_model="fault_preprocess",
                                classifier_model="fault_queue", embedder_model="fault_embedder"),
                        max_batch_size=1, instance_count=8),
    variant(S.PIPELINE, "pipeline_crash", preprocess_model="fault_preprocess",
            classifier_model="fault_crash", embedder_model="fault_embedder",
            default_deadline_ms="3000"),
    # A classifier the degradation test makes slow for a while; 8 sub-request threads per
    # instance bound what it may have out on it (tests/live/test_degradation.py).
    variant(S.PIPELINE, "pipeline_slow", preprocess_model="fault_preprocess",
            classifier_model="fault_slow", embedder_model="fault_embedder",
            default_deadline_ms="1000", subrequest_threads="8"),
    # Its own model for the overload test (tests/live/test_failure_paths.py), which slows the
    # classifier per request: each instance runs one batch at a time, so a burst far beyond
    # 2 x 16 rows waits in Triton's queue of this model, where the queue policy applies each
    # request's timeout, away from the queues of the models other tests use.
    dataclasses.replace(variant(S.PIPELINE, "pipeline_overload", preprocess_model="fault_preprocess",
                                classifier_model="fault_classifier", embedder_model="fault_embedder",
                                max_owed_answers="0"),
                        batching=QUEUED_BLS_BATCHING),
)


def variant_named(name: str) -> S.ModelSpec:
    return next(model for model in VARIANTS if model.name == name)


def real_model_variants(real_repository: Path) -> tuple[S.ModelSpec, ...]:
    """Orchestrator variants over the real sub-models (found in ``real_repository``)."""
    return (
        # Admits little: 2 instances each running one batch of up to 16 rows and a queue of 16
        # in Triton (its queue policy's max_queue_size), 48 requests in all, so a burst of a
        # few hundred is mostly refused at once (tests/live/test_degradation.py).
        dataclasses.replace(
            variant(S.PIPELINE, "pipeline_admission",
                    stage_model_repositories=str(real_repository)),
            batching=dataclasses.replace(QUEUED_BLS_BATCHING, max_queue_size=16)),
        # The GPU profiles' path on this CPU-only server: PIXELS kept by DLPack although it is
        # in host memory, out of preprocess's sub-response and into the next sub-requests
        # (tests/live/test_pipelines.py).
        variant(S.PIPELINE, "pipeline_gpu_tensors", gpu_tensors="always",
                stage_model_repositories=str(real_repository)),
        # The real preprocess and classifier, and an embedder that can be made sick
        # (tests/live/test_failure_paths.py).
        variant(S.PIPELINE, "pipeline_sick", embedder_model="fault_sick",
                stage_model_repositories=str(real_repository)),
        # The classifier stage on the poisonable model (tests/live/test_backend_errors.py), and
        # the embedder stage on one that batches as the real embedder (tests/live/test_isolation.py).
        variant(S.PIPELINE, "pipeline_poison", classifier_model=FAULT_BATCH.name,
                stage_model_repositories=str(real_repository)),
        variant(S.PIPELINE, "pipeline_poison_embedder", embedder_model=FAULT_BATCH_EMBEDDER.name,
                stage_model_repositories=str(real_repository)),
        # `pipeline` and its ensemble with the classifier stage on fault_park, every other stage
        # real: head-of-line blocking, orchestrator against ensemble
        # (tests/live/test_head_of_line.py).
        variant(S.PIPELINE, "pipeline_park", classifier_model="fault_park",
                stage_model_repositories=str(real_repository)),
        variant(S.PIPELINE, "pipeline_park_bound0", classifier_model="fault_park",
                max_owed_answers="0", stage_model_repositories=str(real_repository)),
        dataclasses.replace(S.PIPELINE_ENSEMBLE, name="pipeline_ensemble_park", ensemble_steps=tuple(
            dataclasses.replace(step, model="fault_park") if step.model == S.CLASSIFIER.name
            else step for step in S.PIPELINE_ENSEMBLE.ensemble_steps)),
        # One instance of `pipeline` over fault_park, with the default bound and with none: a
        # stub killed with requests parked; and over fault_park_single, whose batch of 1 makes
        # each request of an execute a group of its own (tests/live/test_head_of_line.py).
        *(dataclasses.replace(variant(S.PIPELINE, name + suffix, classifier_model=classifier,
                                      stage_model_repositories=str(real_repository), **bound),
                              instance_count=1)
          for name, classifier in (("pipeline_park1", "fault_park"),
                                   ("pipeline_park_single", "fault_park_single"))
          for suffix, bound in (("", {}), ("_bound0", {"max_owed_answers": "0"}))),
        # The cascade that never escalates and the one that always does
        # (tests/live/test_cascade.py).
        variant(S.DIGITS_CASCADE, "digits_cascade_never", threshold="0",
                stage_model_repositories=str(real_repository)),
        variant(S.DIGITS_CASCADE, "digits_cascade_always", threshold="1.5",
                stage_model_repositories=str(real_repository)),
    )

def build(target: Path, real_repository: Path, variants=None) -> Path:
    """Write the fault models and ``variants`` (default: VARIANTS and the real-model variants)
    into ``target`` (a fresh directory)."""
    if variants is None:
        variants = (*VARIANTS, *real_model_variants(real_repository))
    for model in FAULT_MODELS:
        write(target, model, FAULT_MODEL)
    for model, output in POISONED_MODELS:
        (target / model.name / "1").mkdir(parents=True)
        (target / model.name / "config.pbtxt").write_text(configs.render(model))
        poison.write(target / model.name / "1" / "model.onnx", output)
    write(target, PROBE, PROBE_MODEL)
    for model in CONTENDED:
        write_onnx(target, model, real_repository / S.CLASSIFIER.name / "1" / "model.onnx")
    for model in variants:
        write(target, model)
    return target


def write_onnx(target: Path, model: S.ModelSpec, onnx_file: Path) -> None:
    """An ONNX model variant (e.g. other batching settings) over an existing model.onnx."""
    (target / model.name / "1").mkdir(parents=True)
    (target / model.name / "config.pbtxt").write_text(configs.render(model))
    shutil.copy(onnx_file, target / model.name / "1" / "model.onnx")


def write(target: Path, model: S.ModelSpec, source: Path | None = None) -> None:
    """A python-backend model: its config, and ``source`` as its model.py (an orchestrator's
    model.py names the pipeline it ``orchestrates``: generated); an ensemble: its config."""
    (target / model.name / "1").mkdir(parents=True)
    (target / model.name / "config.pbtxt").write_text(configs.render(model))
    if model.orchestrates:
        (target / model.name / "1" / "model.py").write_text(configs.model_py(model.orchestrates))
    elif source is not None:
        shutil.copy(source, target / model.name / "1" / "model.py")
