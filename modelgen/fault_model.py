"""Fault model (tests and benchmarks only; never in model_repository/): stands in for a pipeline
stage and misbehaves on request.

It has the tensors of the stage it replaces (from its config) and answers zeros, unless the
request id carries a directive for it. The orchestrators forward the client's request id to every
sub-request, so a test steers one stage of one request by naming this model in the id:

    "<anything>;fault_classifier:delay:1500"   sleep 1.5 s, then answer
    "fault_embedder:error:boom"                answer with an error "fault injected: boom"
    "fault_crash:crash"                        kill this stub process (os._exit)
    "fault_park:park:1500"                     answer 1.5 s later through the request's
                                               sender: the instance serves others meanwhile

Several directives can be joined with ';'. Directives for other models are ignored. A coalesced
sub-request carries its members' ids joined with ',': each member's directives count, and as in
any batch a delay or an error applies to the whole execution.

A model can also be made slow for every request, as a degraded dependency would be: while the
file ``slow_ms`` exists in its model directory, each execution first sleeps that many
milliseconds (tests write it, then remove it to let the model recover). Likewise, while the file
``error`` exists, every request is answered with its text as the error: a sick model, failing
every request whatever its data.
"""

import json
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]
        config = json.loads(args["model_config"])
        self.outputs = {t["name"]: (pb_utils.triton_string_to_numpy(t["data_type"]),
                                    [int(d) for d in t["dims"]]) for t in config["output"]}
        self.input_name = config["input"][0]["name"]
        self.slow_file = os.path.join(args["model_repository"], "slow_ms")
        self.error_file = os.path.join(args["model_repository"], "error")

    def slowdown_ms(self):
        try:
            with open(self.slow_file) as handle:
                return float(handle.read())
        except (OSError, ValueError):
            return 0.0

    def sick(self):
        try:
            with open(self.error_file) as handle:
                return handle.read().strip() or "sick"
        except OSError:
            return None

    def directives(self, request):
        found = []
        for member in request.request_id().split(","):
            for token in member.split(";"):
                parts = token.strip().split(":", 2)
                if len(parts) >= 2 and parts[0] == self.name:
                    found.append((parts[1], parts[2] if len(parts) > 2 else ""))
        return found

    def execute(self, requests):
        plans = [self.directives(request) for request in requests]
        # Delays apply to the whole batch (tests send a slow request alone).
        delay = max([float(arg) for plan in plans for action, arg in plan if action == "delay"]
                    + [self.slowdown_ms()])
        if delay:
            time.sleep(delay / 1000.0)
        sick = self.sick()
        if sick is not None:
            return [pb_utils.InferenceResponse(error=pb_utils.TritonError(sick))
                    for _ in requests]
        responses = []
        for request, plan in zip(requests, plans):
            actions = dict(plan)
            if "crash" in actions:
                os._exit(1)
            if "error" in actions:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(f"fault injected: {actions['error']}")))
                continue
            batch = pb_utils.get_input_tensor_by_name(request, self.input_name).as_numpy().shape[0]
            wanted = request.requested_output_names() or list(self.outputs)
            response = pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor(name, np.zeros([batch, *self.outputs[name][1]], self.outputs[name][0]))
                for name in wanted])
            if "park" in actions:  # a None entry: answered later, its instance free meanwhile
                threading.Timer(float(actions["park"]) / 1000.0, request.get_response_sender().send,
                                (response,), {"flags": pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL}
                                ).start()
                response = None
            responses.append(response)
        return responses
