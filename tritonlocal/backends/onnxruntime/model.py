"""A Python-based Triton backend named ``onnxruntime``, for running the repository on CPU.

The tritonserver bundled in the ``nvidia-pytriton`` wheel ships no onnxruntime backend. Triton
loads ``<backend-directory>/onnxruntime/model.py`` for every model whose config says
``backend: "onnxruntime"``, so the committed ``config.pbtxt`` files are exactly the ones the real
C++ onnxruntime backend loads in the NGC container. The launcher installs this file there.

What it does like the real backend: reads ``<version>/model.onnx`` (or
``default_model_filename``), honours ``max_batch_size`` and the ``intra_op_thread_count`` /
``inter_op_thread_count`` parameters, and fails to load when the ONNX file's inputs and outputs
disagree with the config. Each ``execute`` runs one ONNX Runtime ``run`` over every request of
the dynamic batch; if that batch run fails, the requests are re-run one by one so that one bad
request fails alone instead of taking its batch with it.
"""

import json
import os

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils

from tritonlocal import onnx_backend as lib


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = args["model_name"]
        filename = config.get("default_model_filename") or "model.onnx"
        path = os.path.join(args["model_repository"], args["model_version"], filename)
        if not os.path.exists(path):
            raise pb_utils.TritonModelException(
                f"model '{self.name}': {path} does not exist (run `make models`)")

        intra, inter = lib.thread_counts(config)
        options = ort.SessionOptions()
        options.intra_op_num_threads = intra
        options.inter_op_num_threads = inter
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])

        def declared(tensors):
            return [lib.OnnxTensor(t.name, t.type, tuple(t.shape)) for t in tensors]

        problems = lib.mismatches(config, declared(self.session.get_inputs()),
                                  declared(self.session.get_outputs()))
        if problems:
            raise pb_utils.TritonModelException(
                f"model '{self.name}': {path} does not match config.pbtxt: " + "; ".join(problems))

        self.max_batch_size = int(config.get("max_batch_size", 0))
        self.input_names = [t["name"] for t in config["input"]]
        self.output_dtypes = {t["name"]: lib.DTYPES[t["data_type"]][1] for t in config["output"]}
        pb_utils.Logger.log_info(
            f"onnxruntime (local) loaded '{self.name}' from {path}: "
            f"intra_op_threads={intra} inter_op_threads={inter} max_batch_size={self.max_batch_size}")

    def execute(self, requests):
        feeds = [self._inputs(request) for request in requests]
        wanted = set()
        for request in requests:
            wanted.update(request.requested_output_names() or self.output_dtypes)
        output_names = [name for name in self.output_dtypes if name in wanted]

        if self.max_batch_size > 0 and len(requests) > 1:
            sizes = [len(feed[self.input_names[0]]) for feed in feeds]
            batch = {name: np.concatenate([f[name] for f in feeds]) for name in self.input_names}
            try:
                results = self.session.run(output_names, batch)
            except Exception:  # noqa: BLE001 - isolate the bad request(s) below
                pass
            else:
                pieces = [lib.split_rows(r, sizes) for r in results]
                return [self._response(output_names, [p[i] for p in pieces])
                        for i in range(len(requests))]
        return [self._run_one(output_names, feed) for feed in feeds]

    def _inputs(self, request):
        return {name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()
                for name in self.input_names}

    def _run_one(self, output_names, feed):
        try:
            return self._response(output_names, self.session.run(output_names, feed))
        except Exception as error:  # noqa: BLE001 - becomes this request's error response
            code = (pb_utils.TritonError.INVALID_ARG if lib.is_invalid_argument(error)
                    else pb_utils.TritonError.INTERNAL)
            message = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            pb_utils.Logger.log_error(f"'{self.name}': inference failed: {error}")
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"onnxruntime: {message}", code))

    def _response(self, output_names, arrays):
        tensors = [pb_utils.Tensor(name, np.ascontiguousarray(array, dtype=self.output_dtypes[name]))
                   for name, array in zip(output_names, arrays)]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self):
        self.session = None
