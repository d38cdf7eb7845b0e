"""What must never be committed: secrets, and generated weights or engines (they are produced
deterministically by `make models` and, on a GPU host, by the engine build script)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SECRET_PATTERNS = {
    "private key": re.compile(rb"-----BEGIN (?:RSA |EC |OPENSSH |DSA |ENCRYPTED )?PRIVATE KEY-----"),
    "AWS access key": re.compile(rb"\bAKIA[0-9A-Z]{16}\b"),
    "GitHub token": re.compile(rb"\bgh[pousr]_[A-Za-z0-9]{36,}\b"),
    "NGC / API key assignment": re.compile(
        rb"(?i)\b(?:ngc_api_key|api[_-]?key|secret|password|token)\s*[:=]\s*[\"']?[A-Za-z0-9+/_\-]{20,}"),
    "Slack token": re.compile(rb"\bxox[abpr]-[A-Za-z0-9-]{10,}\b"),
}
GENERATED = (".onnx", ".plan", ".engine", ".trt", ".pt", ".pth", ".bin", ".safetensors")
MAX_BYTES = 2 * 2**20


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (e.g. the repository copied into the container)")
    return [ROOT / name.decode() for name in out.split(b"\0") if name]


def test_no_secret_is_committed():
    found = []
    for path in tracked_files():
        if path.is_file():
            data = path.read_bytes()
            found += [f"{path.relative_to(ROOT)}: {kind}" for kind, pattern in SECRET_PATTERNS.items()
                      if pattern.search(data)]
    assert found == []


def test_the_patterns_would_catch_a_secret():
    # Assembled at run time, so this file itself holds no match.
    samples = {"private key": b"-----BEGIN " + b"RSA PRIVATE KEY-----",
               "AWS access key": b"AKIA" + b"ABCDEFGHIJKLMNOP",
               "NGC / API key assignment": b"NGC_API_KEY=" + b"a" * 40}
    for kind, sample in samples.items():
        assert SECRET_PATTERNS[kind].search(sample), kind


def test_no_weights_or_engines_are_committed():
    generated = [str(p.relative_to(ROOT)) for p in tracked_files() if p.suffix in GENERATED]
    assert generated == []
    large = [f"{p.relative_to(ROOT)} ({p.stat().st_size} bytes)" for p in tracked_files()
             if p.is_file() and p.stat().st_size > MAX_BYTES]
    assert large == []
