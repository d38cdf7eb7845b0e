"""What the orchestrators compute, with no Triton in sight.

Each pipeline is an ``async`` function ``run(inputs, call, setup)`` over numpy arrays that
reaches its sub-models only through ``await call(stage, inputs, output_names)`` and runs
independent ones together with ``await gather_all(...)``; its ``PipelineDef`` in ``spec`` names
it. The runtime drives it (``bls_models.flow``) and sends each sub-request; tests drive it with
``flow.run`` over fake sub-models. A pipeline raises ``PipelineError`` for anything the client
should hear about.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Protocol, Sequence

import numpy as np

from bls_models import flow
from bls_models import spec as S
from bls_models.definition import Setup
from bls_models.errors import InvalidInput


# Computes a stage's result from its outputs where they arrive, without copying them first:
# {output name: array} -> {name: new array}. It must not keep references to its inputs.
Reduce = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


class SubModelCall(Protocol):
    def __call__(self, stage: str, inputs: dict[str, np.ndarray], outputs: Sequence[str],
                 reduce: Reduce | None = None) -> Awaitable[dict[str, np.ndarray]]: ...


def softmax_top_k(logits: np.ndarray, k: int = S.TOP_K) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` class ids (INT64) and softmax probabilities (FP32), most probable first.

    Ties go to the lower class id, as in ONNX TopK (which the ensemble uses).
    """
    shifted = logits.astype(np.float32) - logits.max(axis=-1, keepdims=True)
    exp = np.exp(shifted)
    probs = exp / exp.sum(axis=-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[..., :k]
    return ids.astype(np.int64), np.take_along_axis(probs, ids, axis=-1).astype(np.float32)


def reduce_tags(logits: np.ndarray, chunk: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Per-token argmax (INT64) and its softmax probability (FP32) from [B, T, vocab] logits.

    Sends 2 x 4 bytes per token instead of 14 041 x 4: 4 KB instead of 28.7 MB per sequence.
    Works one sequence and ``chunk`` tokens at a time in one reused float32 buffer (1.8 MB at 32
    tokens, within the caches). Measured per sequence: 6 ms on one dev host, where the
    straightforward version (fresh temporaries, a float64 sum, 57 MB of temporaries the allocator
    kept) took 31 ms; 19 ms on a slower, AVX2-only host, where 64-token chunks took 27 ms. The
    work is memory-bound: it reads all 28.7 MB at least twice. The buffer's size does not depend
    on the batch: coalesced groups of 1 to 4 sequences had made it 1.8 to 7.2 MB, sizes the
    allocator's threads kept a growing mix of (+90 MiB on one stub over 3 000 requests).
    """
    batch, tokens, vocab = logits.shape
    tags = np.empty((batch, tokens), np.int64)
    probs = np.empty((batch, tokens), np.float32)
    buffer = np.empty((min(chunk, tokens), vocab), np.float32)
    for row in range(batch):
        for start in range(0, tokens, chunk):
            part = logits[row, start:start + chunk]
            scratch = buffer[:part.shape[0]]
            tags[row, start:start + chunk] = part.argmax(axis=-1)
            # p(argmax) = exp(l_max) / sum(exp(l)) = 1 / sum(exp(l - l_max))
            np.subtract(part, part.max(axis=-1, keepdims=True), out=scratch)
            np.exp(scratch, out=scratch)
            probs[row, start:start + chunk] = 1.0 / scratch.sum(axis=-1)
    return tags, probs


def check_tokens(inputs: dict[str, np.ndarray]) -> None:
    """``tag_pipeline``'s check of one request: every token id in the vocabulary."""
    tokens = inputs[S.TOKENS.name]
    if tokens.size and (tokens.min() < 0 or tokens.max() >= S.TAGGER_VOCAB):
        bad = tokens[(tokens < 0) | (tokens >= S.TAGGER_VOCAB)]
        raise InvalidInput(
            f"TOKENS must be token ids in [0, {S.TAGGER_VOCAB}); got {bad.size} outside, "
            f"e.g. {int(bad.flat[0])}")


async def image_pipeline(inputs: dict[str, np.ndarray], call: SubModelCall,
                         setup: Setup = Setup()) -> dict[str, np.ndarray]:
    """IMAGE -> preprocess -> (classifier || embedder) -> CLASS_IDS, CLASS_PROBS, EMBEDDING."""
    pixels = (await call("preprocess", {S.IMAGE.name: inputs[S.IMAGE.name]},
                         [S.PIXELS.name]))[S.PIXELS.name]

    async def classify():  # top-5 while the embedder runs
        logits = await call("classifier", {S.PIXELS.name: pixels}, [S.CLASS_LOGITS.name])
        return softmax_top_k(logits[S.CLASS_LOGITS.name])

    (ids, probs), embedded = await gather_all(
        classify(), call("embedder", {S.PIXELS.name: pixels}, [S.EMBEDDING.name]))
    return {S.CLASS_IDS.name: ids, S.CLASS_PROBS.name: probs,
            S.EMBEDDING.name: embedded[S.EMBEDDING.name]}


def _reduce_tagger_outputs(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    tags, probs = reduce_tags(outputs[S.TAG_LOGITS.name])
    return {S.TAGS.name: tags, S.TAG_PROBS.name: probs}


async def tag_pipeline(inputs: dict[str, np.ndarray], call: SubModelCall,
                       setup: Setup = Setup()) -> dict[str, np.ndarray]:
    """TOKENS -> tagger -> TAGS, TAG_PROBS.

    The 28.7 MB-per-sequence logits never leave the server. When the tagger stage's model meets
    the ``tagger_tags`` contract (the default; ``setup.contracts``), it computes TAGS and
    TAG_PROBS in its own graph, so the logits never leave ONNX Runtime either. A model with the
    tagger's LOGITS instead has them reduced as they arrive, on the sub-request's thread, from
    the copy the python backend makes of every sub-response output; no copy of them is made
    here. The token ids were checked per request (``check_tokens``).
    """
    tokens = inputs[S.TOKENS.name]
    if S.reduces_tags(setup.contracts.get("tagger", S.TAGGER_TAGS)):
        return await call("tagger", {S.TOKENS.name: tokens}, [S.TAGS.name, S.TAG_PROBS.name])
    return await call("tagger", {S.TOKENS.name: tokens}, [S.TAG_LOGITS.name],
                      reduce=_reduce_tagger_outputs)


def gather_all(*awaitables: Awaitable) -> Awaitable[list]:
    """Await every branch to the end, then raise the first ``PipelineError`` among their
    failures (else the first other failure); their results in order otherwise. Unlike a bare
    ``asyncio.gather``, no branch is left running unobserved when another fails: every
    sub-request a request issued is accounted for before the request is answered."""
    return flow.gather(*awaitables)


class _ContractSend:
    """Sends each sub-request to a stand-in that holds it to the contract its stage's model meets
    and answers zeros of the contract's shapes (``contract_problems``)."""

    def __init__(self, contracts: dict[str, S.ModelSpec]) -> None:
        self.contracts, self.problems, self.stages = contracts, [], set()

    def __call__(self, sub: flow.SubRequest):
        stage, inputs, outputs, reduce = sub.stage, sub.inputs, sub.outputs, sub.reduce
        contract = self.contracts.get(stage)
        if contract is None:
            raise AssertionError(f"a sub-request to stage '{stage}', which the pipeline lacks")
        self.stages.add(stage)
        names = f"stage '{stage}' (a model like '{contract.name}')"
        given, wanted = set(inputs), {t.name for t in contract.inputs}
        if given != wanted:
            self.problems.append(f"{names} takes {sorted(wanted)}, the pipeline sent "
                                 f"{sorted(given)}")
        for name, value in inputs.items():
            if name in wanted:
                tensor = contract.input(name)
                if (tuple(value.shape[1:]) != tensor.dims
                        or np.dtype(value.dtype) != np.dtype(S.DTYPES[tensor.dtype])):
                    self.problems.append(
                        f"{names}: input '{name}' is {value.dtype} {list(value.shape[1:])}, the "
                        f"contract says {tensor.dtype} {list(tensor.dims)}")
        unknown = [n for n in outputs if n not in {t.name for t in contract.outputs}]
        if unknown:
            self.problems.append(f"{names} has no output {unknown}")
        batch = len(next(iter(inputs.values()))) if inputs else 1
        result = {t.name: np.zeros((batch, *t.dims), S.DTYPES[t.dtype])
                  for t in contract.outputs if t.name in outputs}
        return reduce(result) if reduce else result


def contract_problems(definition, batch: int = 1) -> list[str]:
    """Run ``definition`` once for every combination of the contracts its stage models may meet,
    on zeros (its check first) through the runtime's driver and stand-in sub-models, and say
    what breaks its contracts: a sub-request with a tensor
    name, shape or dtype its stage's contract lacks, a stage never called, an output missing or of
    the wrong shape or dtype. Run by ``python -m modelgen.configs --pipeline`` and the tests; no
    server needed."""
    import itertools

    problems: list[str] = []
    stages = list(definition.contracts)
    for chosen in itertools.product(*definition.contracts.values()):
        contracts = dict(zip(stages, chosen))
        call = _ContractSend(contracts)
        inputs = {t.name: np.zeros((batch, *t.dims), S.DTYPES[t.dtype]) for t in definition.inputs}
        setup = Setup(options=definition.parse({}).options, contracts=contracts)
        where = ", ".join(f"{s} like '{c.name}'" for s, c in contracts.items())
        try:
            check = definition.check_function()
            if check is not None:
                check(inputs)
            outputs = flow.run(definition.run_function()(inputs, flow.SubRequest, setup), call)
        except Exception as error:  # noqa: BLE001 - reported, with the contracts it ran under
            problems.append(f"with {where}: the pipeline raised {type(error).__name__}: {error}")
            continue
        problems += [f"with {where}: {p}" for p in call.problems]
        for stage in sorted(set(stages) - call.stages):
            problems.append(f"with {where}: stage '{stage}' was never called")
        for tensor in definition.outputs:
            value = outputs.get(tensor.name)
            if value is None:
                problems.append(f"with {where}: no output '{tensor.name}'")
            elif (tuple(value.shape) != (batch, *tensor.dims)
                  or np.dtype(value.dtype) != np.dtype(S.DTYPES[tensor.dtype])):
                problems.append(f"with {where}: output '{tensor.name}' is {value.dtype} "
                                f"{list(value.shape)}, the pipeline declares {tensor.dtype} "
                                f"{[batch, *tensor.dims]}")
    return problems
