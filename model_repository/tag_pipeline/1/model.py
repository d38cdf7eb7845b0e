"""`tag_pipeline`: TOKENS -> tagger -> per-token argmax (TAGS) and its probability (TAG_PROBS).

Thin on purpose: the orchestration lives in the `bls_models` package (installed into the
server's Python environment), which reads this model's parameters from config.pbtxt.
"""

import triton_python_backend_utils as pb_utils

from bls_models.triton_runtime import Orchestrator


class TritonPythonModel:
    def initialize(self, args):
        self.orchestrator = Orchestrator(pb_utils, args, pipeline="tag_pipeline")

    def execute(self, requests):
        # Returns None: every request is answered through its response sender.
        return self.orchestrator.execute(requests)

    def finalize(self):
        self.orchestrator.close()
