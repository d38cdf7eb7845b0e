"""`pipeline`'s contract as the plainest per-batch BLS: the anchor the runtime is measured against
(bench only; `bench/anchors.py` serves it as `pipeline_minimal`).

A synchronous `execute`: stack the batch's images, `exec` preprocess, the classifier on one
thread while the embedder runs on this one, split the rows, return every answer. No deadlines,
isolation, cancellation or metrics: what any orchestration of these three sub-models costs at
least on r24.10. Its stage models are `pipeline`'s `<stage>_model` parameters.
"""

import concurrent.futures
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from bls_models.pipelines import softmax_top_k


def call(model, name, value, output, request_id):
    response = pb_utils.InferenceRequest(
        model_name=model, inputs=[pb_utils.Tensor(name, value)], requested_output_names=[output],
        request_id=request_id,
        preferred_memory=pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0)).exec()
    if response.has_error():
        raise pb_utils.TritonModelException(response.error().message())
    return pb_utils.get_output_tensor_by_name(response, output).as_numpy()


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.models = {stage: parameters.get(f"{stage}_model", {}).get("string_value", stage)
                       for stage in ("preprocess", "classifier", "embedder")}
        self.branch = concurrent.futures.ThreadPoolExecutor(1)

    def execute(self, requests):
        images = [pb_utils.get_input_tensor_by_name(r, "IMAGE").as_numpy() for r in requests]
        ids = ",".join(r.request_id() for r in requests)
        pixels = call(self.models["preprocess"], "IMAGE", np.concatenate(images), "PIXELS", ids)
        classified = self.branch.submit(call, self.models["classifier"], "PIXELS", pixels,
                                        "LOGITS", ids)
        embedding = call(self.models["embedder"], "PIXELS", pixels, "EMBEDDING", ids)
        top, probs = softmax_top_k(classified.result())
        responses, start = [], 0
        for image in images:
            rows = slice(start, start + len(image))
            start += len(image)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("CLASS_IDS", top[rows]),
                pb_utils.Tensor("CLASS_PROBS", probs[rows]),
                pb_utils.Tensor("EMBEDDING", embedding[rows])]))
        return responses
