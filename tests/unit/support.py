"""What the runtime's unit tests share: an orchestrator over the fake ``pb_utils`` with the
committed ``config.pbtxt`` (its parameters as they ship, unless a test overrides one),
in-process sub-models, and waiting for answers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from google.protobuf import json_format

from bls_models import repository
from bls_models import spec as S
from bls_models.metrics import FLUSH_SECONDS
from bls_models.triton_runtime import Orchestrator
from tests.unit.fake_pb_utils import FakePbUtils, Request, SubModelError

ROOT = Path(__file__).resolve().parents[2]
REPOSITORY = ROOT / "model_repository"


def committed_config(model: str) -> dict:
    """``model_repository/<model>/config.pbtxt`` as the JSON dict Triton hands ``initialize``."""
    config = repository.load_config(REPOSITORY / model / "config.pbtxt")
    return json_format.MessageToDict(config, preserving_proto_field_name=True)


def orchestrator(pb: FakePbUtils, model: str = "pipeline", pipeline=None,
                 **parameters: str) -> Orchestrator:
    """``model``'s orchestrator as committed, with ``parameters`` set over its config's."""
    config = committed_config(model)
    config["parameters"].update({k: {"string_value": v} for k, v in parameters.items()})
    return Orchestrator(pb, {"model_name": model, "model_config": json.dumps(config),
                             "model_repository": str(REPOSITORY / model)},
                        pipeline or model)


def delay_for(request, model: str) -> float:
    """Seconds a fake sub-model sleeps: the request id may carry ``<model>=<seconds>`` (a
    group's ids are joined by commas: the longest applies)."""
    delay = 0.0
    for member in request.request_id.split(","):
        for part in member.split(";"):
            name, _, seconds = part.partition("=")
            if name == model:
                delay = max(delay, float(seconds))
    return delay


def sub_models(fail: set[str] = frozenset()) -> dict:
    """``pipeline``'s stage models, answering random rows of the right shapes."""
    def model(name, outputs):
        def run(inputs, request):
            time.sleep(delay_for(request, name))
            if name in fail:
                raise SubModelError(f"{name} failed on purpose")
            batch = next(iter(inputs.values())).shape[0]
            rng = np.random.default_rng(batch)
            return {t.name: rng.standard_normal((batch, *t.dims)).astype(np.float32)
                    for t in outputs}
        return run

    return {m.name: model(m.name, m.outputs) for m in (S.PREPROCESS, S.CLASSIFIER, S.EMBEDDER)}


def image(batch: int = 1) -> dict[str, np.ndarray]:
    return {"IMAGE": np.zeros((batch, *S.IMAGE.dims), np.uint8)}


def wait_answered(requests: list[Request], timeout: float = 10.0) -> None:
    give_up = time.monotonic() + timeout
    for request in requests:
        assert request.sender.done.wait(max(0.0, give_up - time.monotonic())), "never answered"


def settled_metric(pb: FakePbUtils, family: str, **labels: str) -> float:
    time.sleep(2 * FLUSH_SECONDS)  # counters are published by the runtime's flush
    return pb.metric(family, **labels)


def counted(pb, orch, family: str, **labels) -> float:
    """A series' value, published or not yet."""
    return pb.metric(family, **labels) + orch.metrics.pending(family, **labels)
