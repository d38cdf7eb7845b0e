"""What each pb_utils call costs in a real r24.10 stub, and how many the orchestrator makes.

``python -m bench.pb_calls`` (``make bench-pb-calls``) answers issue 21's "what does each
pb_utils call cost per request, and which does the python backend require", in three parts,
written to ``bench/results/pb_calls.md`` (and ``.json``):

1. **Cost per call.** A python-backend model, ``callcost``, times each call it is asked to
   (``time.perf_counter``, the median and p90 of ``CALLS`` calls, in µs) inside its own stub, on
   the project's server, with nothing else running: reading a request (id, timeout, requested
   outputs, an IMAGE input as numpy), the response sender and ``is_cancelled``, building output
   tensors and a response, building a sub-request and its ``exec`` (to an ONNX identity model:
   the round trip alone; to the ``fast`` classifier with one image: the same bytes as
   ``pipeline``'s), a metric increment, and the final ``send`` of each request it answered.
2. **Answering: response senders or responses returned from ``execute``.** Four trivial
   python models with ``pipeline``'s inputs, outputs and batching (one IMAGE in, its three
   outputs out, constant): answering through the response sender, the same plus one
   ``is_cancelled``, returning the responses from ``execute``, and Triton's BLS example written
   over the fast sub-models (three blocking ``exec`` per request, responses returned). perf_analyzer
   (gRPC) drives each at concurrency 16 (req/s, stub and tritonserver CPU per request) and 1
   (p50).
3. **Calls per request of the orchestrator**, counted over the unit tests' r24.10-like fake
   ``pb_utils`` (tests/unit/fake_pb_utils.py): the committed ``pipeline`` (its config's
   parameters), its requests arriving one per ``execute`` and four per ``execute``, answered
   in ``execute``'s list, and requests whose deadline passes while their classifier still runs,
   which ``execute``'s thread answers through their response senders while a batch-mate runs
   on (``SETUPS``).

Multiply 3 by 1 for the cost of the calls; the rest of the stub's CPU per request
(``make bench-overhead``) is the runtime's own Python. The repository given is only read.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

from bench import overhead, perf, profile
from tritonlocal import TritonServer, on_free_ports

ROOT = Path(__file__).resolve().parents[1]
CALLS = 2000          # calls per measured pb_utils call (part 1)
SEND_REQUESTS = 300   # requests whose final send is timed (part 1)
CONCURRENCY = 16
SECONDS = 8.0

_CALLCOST = '''
import json
import time

import numpy as np
import triton_python_backend_utils as pb

SENDS = []  # µs of each final send


def timed(function, calls):
    spent = []
    for _ in range(calls):
        started = time.perf_counter()
        function()
        spent.append(time.perf_counter() - started)
    return summary(spent)


def summary(spent):
    spent = sorted(spent)
    if not spent:
        return {}
    return {"p50_us": 1e6 * spent[len(spent) // 2], "p90_us": 1e6 * spent[int(len(spent) * 0.9)],
            "calls": len(spent)}


class TritonPythonModel:
    def initialize(self, args):
        # The family must outlive its metrics.
        self.family = pb.MetricFamily(name="callcost_total", description="calls",
                                      kind=pb.MetricFamily.COUNTER)
        self.metric = self.family.Metric(labels={"model": "callcost"})

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            calls = int(pb.get_input_tensor_by_name(request, "CALLS").as_numpy().reshape(-1)[0])
            report = self.measure(request, sender, calls) if calls > 0 else {
                "final send()": summary(SENDS)}
            response = pb.InferenceResponse(output_tensors=[pb.Tensor(
                "REPORT", np.array([json.dumps(report).encode()], dtype=np.object_))])
            started = time.perf_counter()
            sender.send(response, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            if calls <= 0:
                SENDS.append(time.perf_counter() - started)
        return None

    def measure(self, request, sender, calls):
        outputs = {"CLASS_IDS": np.zeros((1, 5), np.int64),
                   "CLASS_PROBS": np.zeros((1, 5), np.float32),
                   "EMBEDDING": np.zeros((1, 256), np.float32)}
        tensors = [pb.Tensor(n, v) for n, v in outputs.items()]
        pixels = np.zeros((1, 3, 224, 224), np.float32)
        small = np.zeros((1, 4), np.float32)

        def image():
            tensor = pb.get_input_tensor_by_name(request, "IMAGE")
            return np.array(tensor.as_numpy(), copy=True)

        def sub_request(model, name, value, output):
            return pb.InferenceRequest(model_name=model, inputs=[pb.Tensor(name, value)],
                                       requested_output_names=[output])

        def exec_(model, name, value, output):
            def run():
                response = sub_request(model, name, value, output).exec()
                if response.has_error():
                    raise RuntimeError(response.error().message())
                return pb.get_output_tensor_by_name(response, output).as_numpy()
            return run

        return {
            "request_id()": timed(request.request_id, calls),
            "timeout()": timed(request.timeout, calls),
            "requested_output_names()": timed(request.requested_output_names, calls),
            "get_input_tensor_by_name + as_numpy + copy (IMAGE, 150 KB)": timed(image, calls),
            "get_response_sender()": timed(request.get_response_sender, calls),
            "is_cancelled()": timed(sender.is_cancelled, calls),
            "Tensor() x3 (pipeline's outputs, 1 row)":
                timed(lambda: [pb.Tensor(n, v) for n, v in outputs.items()], calls),
            "InferenceResponse(3 tensors)":
                timed(lambda: pb.InferenceResponse(output_tensors=tensors), calls),
            "InferenceRequest() (PIXELS, 602 KB)":
                timed(lambda: sub_request("classifier", "PIXELS", pixels, "LOGITS"), calls),
            "exec() to an ONNX identity (4 floats), output read": timed(
                exec_("identity", "X", small, "Y"), calls),
            "exec() to the fast classifier (PIXELS, 602 KB), output read": timed(
                exec_("classifier", "PIXELS", pixels, "LOGITS"), calls // 4),
            "metric increment()": timed(lambda: self.metric.increment(1), calls),
        }

'''

_CALLCOST_CONFIG = '''
name: "callcost"
backend: "python"
max_batch_size: 0
input { name: "CALLS" data_type: TYPE_INT32 dims: [ 1 ] }
input { name: "IMAGE" data_type: TYPE_UINT8 dims: [ 1, 224, 224, 3 ] }
output { name: "REPORT" data_type: TYPE_STRING dims: [ 1 ] }
instance_group { count: 1 kind: KIND_CPU }
'''

_IDENTITY_CONFIG = '''
name: "identity"
backend: "onnxruntime"
max_batch_size: 8
input { name: "X" data_type: TYPE_FP32 dims: [ 4 ] }
output { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }
instance_group { count: 1 kind: KIND_CPU }
'''

# Part 2: trivial answers with pipeline's contract and batching.
_ECHO = '''
import numpy as np
import triton_python_backend_utils as pb

MODE = "{mode}"


class TritonPythonModel:
    def execute(self, requests):
        returned = []
        for request in requests:
            image = pb.get_input_tensor_by_name(request, "IMAGE").as_numpy()
            rows = len(image)
            if MODE == "example_bls":
                outputs = self.bls(image)
            else:
                outputs = {{"CLASS_IDS": np.zeros((rows, 5), np.int64),
                           "CLASS_PROBS": np.zeros((rows, 5), np.float32),
                           "EMBEDDING": np.zeros((rows, 256), np.float32)}}
            response = pb.InferenceResponse(
                output_tensors=[pb.Tensor(n, v) for n, v in outputs.items()])
            if MODE in ("send", "send_cancelled"):
                sender = request.get_response_sender()
                if MODE == "send_cancelled":
                    sender.is_cancelled()
                sender.send(response, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                returned.append(response)
        return returned or None

    def bls(self, image):
        pixels = self.call("preprocess", "IMAGE", image, "PIXELS")
        logits = self.call("classifier", "PIXELS", pixels, "LOGITS")
        embedding = self.call("embedder", "PIXELS", pixels, "EMBEDDING")
        ids = np.argsort(-logits, axis=1)[:, :5]
        exp = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = np.take_along_axis(exp / exp.sum(axis=1, keepdims=True), ids, axis=1)
        return {{"CLASS_IDS": ids.astype(np.int64), "CLASS_PROBS": probs.astype(np.float32),
                "EMBEDDING": embedding}}

    def call(self, model, name, value, output):
        response = pb.InferenceRequest(model_name=model, inputs=[pb.Tensor(name, value)],
                                       requested_output_names=[output]).exec()
        if response.has_error():
            raise pb.TritonModelException(response.error().message())
        return pb.get_output_tensor_by_name(response, output).as_numpy()
'''

ECHOES = {
    "answer_send": ("send", "response sender: one final send() per request, execute returns None"),
    "answer_send_cancelled": ("send_cancelled", "the same, plus one is_cancelled() per request"),
    "answer_return": ("return", "responses returned from execute (Triton's examples)"),
    "example_bls": ("example_bls", "Triton's BLS example over the fast sub-models: three "
                                   "blocking exec() per request, responses returned"),
}


def _echo_config(name: str, pipeline_config: str) -> str:
    """``pipeline``'s config (inputs, outputs, batching, instances) under another name, with
    its orchestrator parameters left out."""
    lines, skip = [], 0
    for line in pipeline_config.splitlines():
        if line.startswith("parameters {"):
            skip = 1
            continue
        if skip:
            skip += line.count("{") - line.count("}")
            continue
        lines.append(line)
    return "\n".join(lines).replace('name: "pipeline"', f'name: "{name}"') + "\n"


def _identity_onnx(path: Path) -> None:
    from onnx import TensorProto, helper, save

    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 4])
    graph = helper.make_graph([helper.make_node("Identity", ["X"], ["Y"])], "identity", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                              producer_name="bench.pb_calls")
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    save(model, str(path))


def build(target: Path, repository: Path) -> Path:
    """The ``overhead`` experiment's fast repository plus this experiment's models."""
    overhead.fast_repository(target, repository)
    for name, text in (("callcost", _CALLCOST), *(
            (model, _ECHO.format(mode=mode)) for model, (mode, _) in ECHOES.items())):
        (target / name / "1").mkdir(parents=True)
        (target / name / "1" / "model.py").write_text(textwrap.dedent(text))
    (target / "callcost" / "config.pbtxt").write_text(_CALLCOST_CONFIG)
    pipeline_config = (target / "pipeline" / "config.pbtxt").read_text()
    for model in ECHOES:
        (target / model / "config.pbtxt").write_text(_echo_config(model, pipeline_config))
    (target / "identity" / "1").mkdir(parents=True)
    (target / "identity" / "config.pbtxt").write_text(_IDENTITY_CONFIG)
    _identity_onnx(target / "identity" / "1" / "model.onnx")
    return target


def call_costs(server: TritonServer) -> dict:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)

    def ask(calls: int) -> dict:
        inputs = [grpcclient.InferInput("CALLS", [1], "INT32"),
                  grpcclient.InferInput("IMAGE", [1, 224, 224, 3], "UINT8")]
        inputs[0].set_data_from_numpy(np.array([calls], np.int32))
        inputs[1].set_data_from_numpy(np.zeros((1, 224, 224, 3), np.uint8))
        result = client.infer("callcost", inputs, client_timeout=600)
        return json.loads(result.as_numpy("REPORT")[0])

    ask(50)  # warm up: the sub-models' sessions, the stub's paths
    for _ in range(SEND_REQUESTS):
        ask(-1)
    costs = ask(CALLS)
    costs.update(ask(0))
    client.close()
    return costs


def answering(server: TritonServer) -> list[dict]:
    rows = []
    for model, (_, what) in ECHOES.items():
        load = profile.drive(server, model, CONCURRENCY, SECONDS, warmup=3.0)
        cpu = load.cpu_ms_per_request()
        rows.append({"model": model, "what": what,
                     "req_s": load.requests / load.seconds,
                     "stub_cpu_ms": cpu.get(f"{model} stubs", 0.0),
                     "tritonserver_cpu_ms": cpu.get("tritonserver", 0.0),
                     "p50_c1_us": perf.p50_at_1(server, model)})
    return rows


# Part 3: (label, executes, each request's (timeout in µs (0: the default deadline), what its id
# tells the fake classifier)). Answered in execute's list, or sent at a 20 ms deadline while the
# group's 60 ms classifier still runs for a batch-mate (execute returns after it).
SETUPS = (("1 per execute, returned", 50, ((0, ""),)),
          ("4 per execute, returned", 50, ((0, ""),) * 4),
          ("2 per execute: 1 sent at its deadline, 1 returned", 20,
           ((20_000, ";classifier=60"), (0, ""))))


def calls_per_request() -> dict[str, dict[str, float]]:
    """pb_utils calls per request of the committed ``pipeline`` over the fake ``pb_utils``."""
    from tests.helpers import orchestrator, wait_answered
    from tests.unit.fake_pb_utils import FakePbUtils, Request
    from tests.unit.row_models import DirectedRowModels, image_of

    counted = {}
    for label, executes, setup in SETUPS:
        pb = FakePbUtils(DirectedRowModels().models())
        orch = orchestrator(pb)
        try:
            time.sleep(0.2)
            before = dict(pb.faults.calls)
            total = 0
            for batch in range(executes):
                requests = [Request(image_of(20 + i), request_id=f"b{batch}-{i}{directions}",
                                    timeout_us=timeout_us)
                            for i, (timeout_us, directions) in enumerate(setup)]
                pb.execute(orch, requests)
                wait_answered(requests)
                total += len(requests)
            counted[label] = {
                name: (count - before.get(name, 0)) / total
                for name, count in sorted(pb.faults.calls.items())
                if count - before.get(name, 0) and name not in ("metric", "Logger")}
        finally:
            orch.close()
    return counted


def report(costs: dict, answers: list[dict], counts: dict, command: str) -> str:
    lines = ["# pb_utils calls: cost and count", "",
             f"`{command}` on {time.strftime('%Y-%m-%d')}: python_backend r24.10 (Triton 2.51, "
             "CPU), this machine. See bench/pb_calls.py for what is measured.", "",
             "## 1. Cost per call inside a stub (µs, nothing else running)", "",
             "| call | p50 µs | p90 µs | calls |", "|---|---|---|---|"]
    for name, stats in costs.items():
        if stats:
            lines.append(f"| {name} | {stats['p50_us']:.1f} | {stats['p90_us']:.1f} | "
                         f"{stats['calls']} |")
    lines += ["", "## 2. Answering: response sender or returned responses "
              f"(perf_analyzer gRPC; concurrency {CONCURRENCY}, {SECONDS:.0f} s accounted; p50 "
              "at concurrency 1)", "",
              "| model | how it answers | req/s | stub CPU ms/req | tritonserver CPU ms/req | "
              "p50 c=1 µs |", "|---|---|---|---|---|---|"]
    for row in answers:
        lines.append(f"| `{row['model']}` | {row['what']} | {row['req_s']:.0f} | "
                     f"{row['stub_cpu_ms']:.3f} | {row['tritonserver_cpu_ms']:.3f} | "
                     f"{row['p50_c1_us']} |")
    names = sorted({name for per in counts.values() for name in per})
    lines += ["", "## 3. pb_utils calls per request of `pipeline` (fake pb_utils)",
              "", "| call | " + " | ".join(counts) + " |", "|---|" + "---|" * len(counts)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{per.get(name, 0):.2f}"
                                                 for per in counts.values()) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pb_calls",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model-repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    counts = calls_per_request()
    with tempfile.TemporaryDirectory(prefix="pb-calls-") as tmp:
        repository = build(Path(tmp) / "model_repository", args.model_repository)
        with TritonServer(on_free_ports(repository, Path(tmp) / "tritonserver.log")) as server:
            costs = call_costs(server)
            answers = answering(server)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pb_calls.json").write_text(json.dumps(
        {"costs": costs, "answering": answers, "calls_per_request": counts}, indent=1))
    text = report(costs, answers, counts, "python -m bench.pb_calls")
    (args.out / "pb_calls.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    from bench.common import run_as_program

    run_as_program(main)
