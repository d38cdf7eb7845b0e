"""`pipeline`'s contract as Triton's BLS example writes it: an `async def execute` that awaits
`async_exec` per request (bench only; `bench/anchors.py` serves it as `design_naive`).

Each request's preprocess, then its classifier and embedder together, answers returned. The
stub waits for the coroutine before the next batch (r24.10 `pb_stub.cc`), so a slow request holds
its instance. Its stage models are `pipeline`'s `<stage>_model` parameters.
"""

import asyncio
import json

import triton_python_backend_utils as pb_utils

from bls_models.pipelines import softmax_top_k


async def call(model, name, value, output, request_id):
    response = await pb_utils.InferenceRequest(
        model_name=model, inputs=[pb_utils.Tensor(name, value)], requested_output_names=[output],
        request_id=request_id, preferred_memory=pb_utils.PreferredMemory(
            pb_utils.TRITONSERVER_MEMORY_CPU, 0)).async_exec()
    if response.has_error():
        raise pb_utils.TritonModelException(response.error().message())
    return pb_utils.get_output_tensor_by_name(response, output).as_numpy()


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.models = {stage: parameters.get(f"{stage}_model", {}).get("string_value", stage)
                       for stage in ("preprocess", "classifier", "embedder")}

    async def execute(self, requests):
        return await asyncio.gather(*(self.answer(request) for request in requests))

    async def answer(self, request):
        image = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy()
        rid = request.request_id()
        pixels = await call(self.models["preprocess"], "IMAGE", image, "PIXELS", rid)
        logits, embedding = await asyncio.gather(
            call(self.models["classifier"], "PIXELS", pixels, "LOGITS", rid),
            call(self.models["embedder"], "PIXELS", pixels, "EMBEDDING", rid))
        top, probs = softmax_top_k(logits)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("CLASS_IDS", top), pb_utils.Tensor("CLASS_PROBS", probs),
            pb_utils.Tensor("EMBEDDING", embedding)])
