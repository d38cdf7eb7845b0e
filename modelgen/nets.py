"""The project's own PyTorch networks behind the ONNX models.

Weights are random but deterministic (a fixed seed per model): the models exist to exercise a
real serving pipeline, not to classify real images. Two sizes:

- ``small`` (default): one pipeline request (preprocess + classifier + embedder) costs about
  7 ms of single-threaded CPU on the 2-core dev machine, so tests and benchmarks finish quickly;
- ``full``: ResNet-50 depth and width for the classifier (bottleneck blocks, [3, 4, 6, 3],
  64..2048 channels) and a MobileNetV2-sized embedder — the cost of real models, for GPU runs;
- ``fast``: the classifier and the embedder reduced to a per-channel mean and one linear map
  (``Fast``), with the same inputs and outputs, so the same bytes move; the other models as in
  ``small``. A sub-model then costs a few tens of microseconds, as on a GPU, and what is left is
  the cost of serving around it: the proxy for a GPU host on a CPU (``make bench-overhead``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from bls_models import spec as S

SIZES = ("small", "full", "fast")


@dataclass(frozen=True)
class ResNetShape:
    widths: tuple[int, ...]  # output channels of each stage (before bottleneck expansion)
    depths: tuple[int, ...]  # blocks per stage
    bottleneck: bool
    stem: int


@dataclass(frozen=True)
class MobileShape:
    # (expansion, out_channels, blocks, stride) per stage, MobileNetV2-style
    stages: tuple[tuple[int, int, int, int], ...]
    stem: int
    head: int


RESNET = {
    # ResNet-18 layout at half width: ~4.5 ms for one image on one core of the 2-core dev machine.
    "small": ResNetShape(widths=(32, 64, 128, 256), depths=(2, 2, 2, 2), bottleneck=False, stem=32),
    "full": ResNetShape(widths=(64, 128, 256, 512), depths=(3, 4, 6, 3), bottleneck=True, stem=64),
}
MOBILE = {
    # ~2.3 ms for one image on one core of the dev machine.
    "small": MobileShape(stages=((4, 32, 2, 2), (4, 64, 2, 2), (4, 128, 2, 2), (4, 256, 1, 2)),
                         stem=24, head=512),
    "full": MobileShape(stages=((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                                (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)),
                        stem=32, head=1280),
}
# small: ~10 ms per sequence on one core (the seed case measured 30-50 ms locally on its model).
TAGGER_HIDDEN = {"small": 96, "full": 256}


class Preprocess(nn.Module):
    """UINT8 [B,H,W,3] -> FP32 [B,3,H,W] = (image / 255 - mean) / std."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(S.IMAGENET_MEAN).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(S.IMAGENET_STD).view(1, 3, 1, 1))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        pixels = image.to(torch.float32).permute(0, 3, 1, 2) / 255.0
        return (pixels - self.mean) / self.std


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    )


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        self.conv1 = _conv_bn(cin, width, 3, stride)
        self.conv2 = _conv_bn(width, width, 3)
        self.shortcut = _conv_bn(cin, width, 1, stride) if stride != 1 or cin != width else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.shortcut is None else self.shortcut(x)
        return F.relu(self.conv2(F.relu(self.conv1(x))) + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = _conv_bn(cin, width, 1)
        self.conv2 = _conv_bn(width, width, 3, stride)
        self.conv3 = _conv_bn(width, cout, 1)
        self.shortcut = _conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.shortcut is None else self.shortcut(x)
        out = F.relu(self.conv2(F.relu(self.conv1(x))))
        return F.relu(self.conv3(out) + identity)


class Classifier(nn.Module):
    """ResNet: stem, four residual stages, global average pool, linear head -> LOGITS."""

    def __init__(self, shape: ResNetShape, num_classes: int = S.NUM_CLASSES) -> None:
        super().__init__()
        block = Bottleneck if shape.bottleneck else BasicBlock
        self.stem = nn.Sequential(_conv_bn(3, shape.stem, 7, 2), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        layers, cin = [], shape.stem
        for stage, (width, depth) in enumerate(zip(shape.widths, shape.depths)):
            for i in range(depth):
                layers.append(block(cin, width, 2 if (i == 0 and stage > 0) else 1))
                cin = width * block.expansion
        self.stages = nn.Sequential(*layers)
        self.norm = nn.BatchNorm1d(cin)  # calibrated by build(): see _calibrate
        self.head = nn.Linear(cin, num_classes)

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.stages(self.stem(pixels)).mean(dim=(2, 3))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.features(pixels)))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, expansion: int, stride: int) -> None:
        super().__init__()
        hidden = cin * expansion
        self.body = nn.Sequential(
            _conv_bn(cin, hidden, 1), nn.ReLU6(),
            _conv_bn(hidden, hidden, 3, stride, groups=hidden), nn.ReLU6(),
            _conv_bn(hidden, cout, 1),
        )
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return x + out if self.residual else out


class Embedder(nn.Module):
    """MobileNetV2-style CNN -> 256-d embedding, L2-normalised inside the graph."""

    def __init__(self, shape: MobileShape, dim: int = S.EMBEDDING_DIM) -> None:
        super().__init__()
        layers: list[nn.Module] = [_conv_bn(3, shape.stem, 3, 2), nn.ReLU6()]
        cin = shape.stem
        for expansion, cout, blocks, stride in shape.stages:
            for i in range(blocks):
                layers.append(InvertedResidual(cin, cout, expansion, stride if i == 0 else 1))
                cin = cout
        layers += [_conv_bn(cin, shape.head, 1), nn.ReLU6()]
        self.body = nn.Sequential(*layers)
        self.norm = nn.BatchNorm1d(shape.head)  # calibrated by build(): see _calibrate
        self.project = nn.Linear(shape.head, dim)

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.body(pixels).mean(dim=(2, 3))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        embedding = self.project(self.norm(self.features(pixels)))
        return F.normalize(embedding, p=2.0, dim=1, eps=1e-12)


class Tagger(nn.Module):
    """Token embedding, a 1-D convolution and a per-token head over the whole vocabulary."""

    def __init__(self, hidden: int, vocab: int = S.TAGGER_VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.mix = nn.Conv1d(hidden, hidden, kernel_size=3, padding=1)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)                                   # [B, T, H]
        x = x + F.gelu(self.mix(x.transpose(1, 2)).transpose(1, 2))
        return self.head(x)                                      # [B, T, vocab]


class TaggerTags(nn.Module):
    """The tagger with its reduction in the graph: per-token argmax and that token's softmax
    probability. Only these 8 bytes per token leave ONNX Runtime; the logits stay inside it."""

    def __init__(self, tagger: Tagger) -> None:
        super().__init__()
        self.tagger = tagger

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.tagger(tokens)
        # One fused softmax (ONNX Softmax) and a max over it: p(argmax) = max(softmax).
        return logits.argmax(dim=-1), torch.softmax(logits, dim=-1).amax(dim=-1)


class Postprocess(nn.Module):
    """Class logits -> top-k class ids and their softmax probabilities, most probable first."""

    def __init__(self, k: int = S.TOP_K) -> None:
        super().__init__()
        self.k = k

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs, ids = torch.topk(torch.softmax(logits, dim=-1), self.k, dim=-1)
        return ids, probs


class Fast(nn.Module):
    """PIXELS [B,3,H,W] -> [B,outputs]: the mean of each colour channel over the image (ONNX
    ReduceMean), then one linear map (MatMul + Add); L2-normalised for an embedding. The
    classifier's or the embedder's contract at almost no cost (size ``fast``)."""

    def __init__(self, outputs: int, normalise: bool) -> None:
        super().__init__()
        self.head = nn.Linear(3, outputs)
        self.normalise = normalise

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        out = self.head(pixels.mean(dim=(2, 3)))
        return F.normalize(out, p=2.0, dim=1, eps=1e-12) if self.normalise else out


# A distinct, fixed seed per model: every export of a model is bit-identical.
# tagger_tags is the tagger with a reduction on top: the same seed, so the same weights.
SEEDS = {"preprocess": 0, "classifier": 1, "embedder": 2, "tagger": 3, "tagger_tags": 3,
         "postprocess": 4}


def build(name: str, size: str = "small") -> nn.Module:
    """The network behind ONNX model ``name``, with deterministic weights, in eval mode."""
    if size not in SIZES:
        raise ValueError(f"unknown model size '{size}' (choose from {', '.join(SIZES)})")
    from modelgen import digits

    if name in digits.MODELS:  # trained on the bundled digits: the same at every size
        return digits.build(name)
    torch.manual_seed(SEEDS[name])
    fast = size == "fast"
    size = "small" if fast else size  # fast: only the classifier and the embedder differ
    factories = {
        "preprocess": Preprocess,
        "classifier": (lambda: Fast(S.NUM_CLASSES, normalise=False)) if fast
        else lambda: Classifier(RESNET[size]),
        "embedder": (lambda: Fast(S.EMBEDDING_DIM, normalise=True)) if fast
        else lambda: Embedder(MOBILE[size]),
        "tagger": lambda: Tagger(TAGGER_HIDDEN[size]),
        "tagger_tags": lambda: TaggerTags(Tagger(TAGGER_HIDDEN[size])),
        "postprocess": Postprocess,
    }
    net = factories[name]()
    _randomise_batchnorm(net)
    net.eval()
    if isinstance(net, (Classifier, Embedder)):
        _calibrate(net)
    return net


def _randomise_batchnorm(net: nn.Module) -> None:
    """Variance-preserving conv weights (He init; PyTorch's default shrinks activations layer by
    layer until a deep random net outputs a constant), and BatchNorm layers with non-trivial
    statistics so the folded graph is actually exercised."""
    for module in net.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_in", nonlinearity="relu")
        if isinstance(module, nn.BatchNorm2d):
            with torch.no_grad():
                module.running_mean.uniform_(-0.1, 0.1)
                module.running_var.uniform_(0.5, 1.5)
                module.weight.uniform_(0.5, 1.0)
                module.bias.uniform_(-0.1, 0.1)


def synthetic_images(count: int, seed: int = 0) -> torch.Tensor:
    """Structured UINT8 images [N,224,224,3]: random 7x7 colour grids scaled up to 224x224.

    Uniform noise is a poor stand-in for images: pooled CNN features of noise are nearly the same
    for every noise image. Blocky images differ at the scales the networks pool over.
    """
    generator = torch.Generator().manual_seed(seed)
    grid = torch.randint(0, 256, (count, 7, 7, 3), dtype=torch.uint8, generator=generator)
    scale = S.IMAGE_SIZE // 7
    return grid.repeat_interleave(scale, dim=1).repeat_interleave(scale, dim=2)


def _calibrate(net: nn.Module) -> None:
    """Data-dependent init of the feature normalisation before the head.

    With random weights, pooled features differ little between images, so every image would get
    the same top-5. Standardising them with statistics from a fixed batch of synthetic images
    (and a larger head) gives outputs that depend on the image, like a trained network's. The
    statistics are computed single-threaded and rounded so exports are bit-identical across
    machines.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            features = net.features(Preprocess()(synthetic_images(32, seed=99)))
            net.norm.running_mean.copy_(torch.round(features.mean(0).double() * 1e4) / 1e4)
            var = features.var(0).double().clamp_min(1e-4)  # dead units: no noise amplification
            net.norm.running_var.copy_(torch.round(var * 1e8) / 1e8)
            net.norm.weight.fill_(1.0)
            net.norm.bias.zero_()
            head = net.head if isinstance(net, Classifier) else net.project
            head.weight.mul_(4.0)
    finally:
        torch.set_num_threads(threads)


def example_input(model: S.ModelSpec, batch: int = 2) -> torch.Tensor:
    """A deterministic, realistic example batch for ``model``'s single input."""
    (tensor,) = model.inputs
    generator = torch.Generator().manual_seed(1234)
    if tensor.name == "IMAGE":
        return synthetic_images(batch, seed=1234)
    if tensor.name == "PIXELS":
        return Preprocess()(synthetic_images(batch, seed=1234))
    if tensor.name == S.DIGIT_PIXELS.name:
        from modelgen import digits

        return digits.example_input(batch)
    if tensor.name == "TOKENS":
        return torch.randint(0, S.TAGGER_VOCAB, (batch, *tensor.dims), dtype=torch.int64,
                             generator=generator)
    return 3.0 * torch.randn((batch, *tensor.dims), generator=generator)
