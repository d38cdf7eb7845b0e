"""What the orchestrators compute, with no Triton in sight.

Each pipeline is an ``async`` function ``run(inputs, call, setup)`` over numpy arrays that
reaches its sub-models only through ``await call(stage, inputs, output_names)`` and runs
independent ones together with ``await gather_all(...)``; its ``PipelineDef`` in ``spec`` names
it. The runtime drives it (``bls_models.drive``) and sends each sub-request; tests drive it with
``drive.drive`` over fake sub-models. A pipeline raises ``PipelineError`` for anything the client
should hear about.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Protocol, Sequence

import numpy as np

from bls_models import drive
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


def check_tokens(inputs: dict[str, np.ndarray], setup: Setup = Setup()) -> None:
    """``tag_pipeline``'s check of one request: from 1 to ``max_tokens`` tokens, each an id in
    the vocabulary."""
    tokens = inputs[S.TOKENS.name]
    longest = setup.options.get("max_tokens", S.MAX_TOKENS)
    if tokens.shape[-1] == 0:
        raise InvalidInput(f"TOKENS is empty: send 1 to {longest} token ids per document")
    if tokens.shape[-1] > longest:
        raise InvalidInput(f"TOKENS has {tokens.shape[-1]} tokens, over the limit of {longest} "
                           "(the tag_pipeline parameter max_tokens)")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= S.TAGGER_VOCAB):
        bad = tokens[(tokens < 0) | (tokens >= S.TAGGER_VOCAB)]
        raise InvalidInput(
            f"TOKENS must be token ids in [0, {S.TAGGER_VOCAB}); got {bad.size} outside, "
            f"e.g. {int(bad.flat[0])}")


def windows(length: int, window: int, overlap: int) -> tuple[list[int], list[int]]:
    """How a document of ``length`` tokens is cut: the start of each ``window``-token window,
    and the end (exclusive) of the tokens each one answers for, in order. The fewest windows
    in which consecutive ones share at least ``overlap`` tokens, spread evenly from the
    document's start to its end. A token is answered by the window where it has the most
    context on its shorter side, i.e. the window whose centre is nearest (the earlier one on a
    tie). A document no longer than a window is one window, padded."""
    if length <= window:
        return [0], [length]
    spans = -(-(length - window) // (window - overlap))  # windows - 1
    starts = [index * (length - window) // spans for index in range(spans + 1)]
    ends = [(first + second + window - 1) // 2 + 1 for first, second in zip(starts, starts[1:])]
    return starts, ends + [length]


PAD_TOKEN = 0  # what a document shorter than a window is padded with


def scatter(values: np.ndarray, rows: slice | list[int], setup: Setup) -> np.ndarray:
    """``values`` computed for ``rows`` (``setup.rows(...)``) as one row per row of the run:
    ``values`` itself when every row asked, else placed at ``rows`` with zeros in the rows that
    did not ask (never answered: each request gets only the outputs it asked for)."""
    if isinstance(rows, slice):
        return values
    full = np.zeros((setup.total_rows, *values.shape[1:]), values.dtype)
    full[rows] = values
    return full


async def image_pipeline(inputs: dict[str, np.ndarray], call: SubModelCall,
                         setup: Setup = Setup()) -> dict[str, np.ndarray]:
    """IMAGE -> preprocess -> (classifier || embedder) -> CLASS_IDS, CLASS_PROBS, EMBEDDING.

    Like the ensemble, it computes only what was asked for: the classifier gets the rows that
    asked for CLASS_IDS or CLASS_PROBS, the embedder those that asked for EMBEDDING, and a
    stage no row needs gets no sub-request."""
    pixels = (await call("preprocess", {S.IMAGE.name: inputs[S.IMAGE.name]},
                         [S.PIXELS.name]))[S.PIXELS.name]
    classes = setup.rows(S.CLASS_IDS.name, S.CLASS_PROBS.name)
    embedded = setup.rows(S.EMBEDDING.name)

    async def classify():  # top-5 while the embedder runs
        logits = await call("classifier", {S.PIXELS.name: pixels[classes]},
                            [S.CLASS_LOGITS.name])
        ids, probs = softmax_top_k(logits[S.CLASS_LOGITS.name])
        return {S.CLASS_IDS.name: scatter(ids, classes, setup),
                S.CLASS_PROBS.name: scatter(probs, classes, setup)}

    async def embed():
        outputs = await call("embedder", {S.PIXELS.name: pixels[embedded]}, [S.EMBEDDING.name])
        return {S.EMBEDDING.name: scatter(outputs[S.EMBEDDING.name], embedded, setup)}

    branches = []
    if setup.wants(S.CLASS_IDS.name, S.CLASS_PROBS.name):
        branches.append(classify())
    if setup.wants(S.EMBEDDING.name):
        branches.append(embed())
    answers = {}
    for outputs in await gather_all(*branches):
        answers.update(outputs)
    return answers


def _reduce_tagger_outputs(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    tags, probs = reduce_tags(outputs[S.TAG_LOGITS.name])
    return {S.TAGS.name: tags, S.TAG_PROBS.name: probs}


async def tag_pipeline(inputs: dict[str, np.ndarray], call: SubModelCall,
                       setup: Setup = Setup()) -> dict[str, np.ndarray]:
    """TOKENS (a document of any length) -> tagger windows -> TAGS, TAG_PROBS per token.

    The documents of a run (one length: a group shares its shapes) are cut into the tagger's
    512-token windows (``windows``); the windows of all of them go to the tagger as the rows of
    one sub-request, or of as few as its ``max_batch_size`` allows, sent at once; each token's
    tag and probability come from the window that answers for it. A document of exactly 512
    tokens is one window, sent as it is.

    The 28.7 MB-per-window logits never leave the server. When the tagger stage's model meets
    the ``tagger_tags`` contract (the default; ``setup.contracts``), it computes TAGS and
    TAG_PROBS in its own graph, so the logits never leave ONNX Runtime either. A model with the
    tagger's LOGITS instead has them reduced as they arrive, on the sub-request's thread, from
    the copy the python backend makes of every sub-response output; no copy of them is made
    here. The token ids and lengths were checked per request (``check_tokens``).
    """
    tokens = inputs[S.TOKENS.name]
    documents, length = tokens.shape
    window = S.TAGGER_SEQ_LEN
    starts, ends = windows(length, window, setup.options.get("window_overlap", S.WINDOW_OVERLAP))
    if length == window:
        cut = tokens
    elif length < window:
        cut = np.full((documents, window), PAD_TOKEN, tokens.dtype)
        cut[:, :length] = tokens
    else:  # [documents * windows, window], each document's windows in order
        cut = tokens[:, np.add.outer(starts, np.arange(window))].reshape(-1, window)
    reduced = S.reduces_tags(setup.contracts.get("tagger", S.TAGGER_TAGS))
    step = setup.max_rows.get("tagger") or len(cut)
    parts = [call("tagger", {S.TOKENS.name: cut[first:first + step]},
                  [S.TAGS.name, S.TAG_PROBS.name] if reduced else [S.TAG_LOGITS.name],
                  reduce=None if reduced else _reduce_tagger_outputs)
             for first in range(0, len(cut), step)]
    if len(parts) == 1:
        answers = await parts[0]
    else:
        got = await gather_all(*parts)
        answers = {name: np.concatenate([part[name] for part in got])
                   for name in (S.TAGS.name, S.TAG_PROBS.name)}
    if length == window:
        return answers
    outputs = {}
    for name, values in answers.items():
        per_window = values.reshape(documents, len(starts), window)
        if length < window:
            outputs[name] = per_window[:, 0, :length]
            continue
        stitched = np.empty((documents, length), values.dtype)
        begin = 0
        for index, (start, end) in enumerate(zip(starts, ends)):
            stitched[:, begin:end] = per_window[:, index, begin - start:end - start]
            begin = end
        outputs[name] = stitched
    return outputs


def gather_all(*awaitables: Awaitable) -> Awaitable[list]:
    """Await every branch to the end, then raise the first ``PipelineError`` among their
    failures (else the first other failure); their results in order otherwise. Unlike a bare
    ``asyncio.gather``, no branch is left running unobserved when another fails: every
    sub-request a request issued is accounted for before the request is answered."""
    return drive.Gather(*awaitables)


class _ContractSend:
    """Sends each sub-request to a stand-in that holds it to the contract its stage's model meets
    and answers zeros of the contract's shapes (``contract_problems``)."""

    def __init__(self, contracts: dict[str, S.ModelSpec]) -> None:
        self.contracts, self.problems, self.stages = contracts, [], set()

    def __call__(self, sub: drive.Call):
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
                if (not _shape_fits(value, len(value), tensor.dims)
                        or np.dtype(value.dtype) != np.dtype(S.DTYPES[tensor.dtype])):
                    self.problems.append(
                        f"{names}: input '{name}' is {value.dtype} {list(value.shape[1:])}, the "
                        f"contract says {tensor.dtype} {list(tensor.dims)}")
        unknown = [n for n in outputs if n not in {t.name for t in contract.outputs}]
        if unknown:
            self.problems.append(f"{names} has no output {unknown}")
        batch = len(next(iter(inputs.values()))) if inputs else 1
        result = {t.name: _zeros(t, batch) for t in contract.outputs if t.name in outputs}
        return reduce(result) if reduce else result


VARIABLE_DIM = 7  # what a -1 dimension is in contract_problems' zeros


def _zeros(tensor: S.TensorSpec, rows: int) -> np.ndarray:
    dims = tuple(VARIABLE_DIM if d < 0 else d for d in tensor.dims)
    return np.zeros((rows, *dims), S.DTYPES[tensor.dtype])


def _shape_fits(value: np.ndarray, rows: int, dims: tuple[int, ...]) -> bool:
    return (value.ndim == len(dims) + 1 and value.shape[0] == rows
            and all(d < 0 or d == v for d, v in zip(dims, value.shape[1:])))


def contract_problems(definition, batch: int = 1) -> list[str]:
    """Run ``definition`` on zeros (its check first) through the runtime's driver and stand-in
    sub-models, and say what breaks its contracts: a sub-request with a tensor name, shape or
    dtype its stage's contract lacks, a stage never called, an output missing or of the wrong
    shape or dtype. It runs once for every combination of the contracts its stage models may
    meet, with every output asked for; then, with the default models, once for each output
    asked for alone, and once with a request asking for that output beside one asking for
    all (a -1 dimension is ``VARIABLE_DIM``). Run by ``python -m modelgen.configs --pipeline``
    and the tests; no server needed."""
    import itertools

    problems: list[str] = []
    stages = list(definition.contracts)
    options = definition.parse({}).options
    every = frozenset(t.name for t in definition.outputs)
    runs = [(dict(zip(stages, chosen)), ()) for chosen in
            itertools.product(*definition.contracts.values())]
    defaults = {stage: contracts[0] for stage, contracts in definition.contracts.items()}
    if len(every) > 1:
        for name in sorted(every):
            runs.append((defaults, ((batch, frozenset({name})),)))
            runs.append((defaults, ((1, frozenset({name})), (batch, every))))
    for contracts, asked in runs:
        call = _ContractSend(contracts)
        rows = sum(count for count, _ in asked) if asked else batch
        inputs = {t.name: _zeros(t, rows) for t in definition.inputs}
        setup = Setup(options=options, contracts=contracts, asked=asked)
        where = ", ".join(f"{s} like '{c.name}'" for s, c in contracts.items())
        if asked:
            where += "; rows asking for " + " then ".join(
                f"{count} x {sorted(names) if names != every else 'all'}"
                for count, names in asked)
        try:
            check = definition.check_function()
            if check is not None:
                for count, _ in asked or ((batch, every),):
                    check({name: value[:count] for name, value in inputs.items()}, setup)
            outputs = drive.drive(definition.run_function()(inputs, drive.Call, setup), call)
        except Exception as error:  # noqa: BLE001 - reported, with the contracts it ran under
            problems.append(f"with {where}: the pipeline raised {type(error).__name__}: {error}")
            continue
        problems += [f"with {where}: {p}" for p in call.problems]
        if not asked:
            for stage in sorted(set(stages) - call.stages):
                problems.append(f"with {where}: stage '{stage}' was never called")
        wanted = frozenset().union(*(names for _, names in asked)) if asked else every
        for tensor in definition.outputs:
            if tensor.name not in wanted:
                continue
            value = outputs.get(tensor.name)
            if value is None:
                problems.append(f"with {where}: no output '{tensor.name}'")
            elif (not _shape_fits(value, rows, tensor.dims)
                  or np.dtype(value.dtype) != np.dtype(S.DTYPES[tensor.dtype])):
                problems.append(f"with {where}: output '{tensor.name}' is {value.dtype} "
                                f"{list(value.shape)}, the pipeline declares {tensor.dtype} "
                                f"{[rows, *tensor.dims]}")
    return problems
