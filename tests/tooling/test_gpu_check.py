"""`make gpu-check`: what it would run (the dry run), what it does on a host without a GPU (one
line, exit 0), and its comparisons with CPU ONNX Runtime. No GPU here: the steps themselves run
only on a GPU host (docs/production.md, "make gpu-check")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import report
from modelgen import configs
from ops import gpu_check as G
from tests.helpers import path_without_nvidia_smi

ROOT = Path(__file__).resolve().parents[2]
STRICT = G.TOLERANCES["gpu"]


def run_make(*args: str) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")},
           "PATH": path_without_nvidia_smi()}
    return subprocess.run(["make", "--no-print-directory", f"PYTHON={sys.executable}", "gpu-check", *args],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)


def test_on_a_host_without_a_gpu_make_gpu_check_says_so_in_one_line_and_succeeds():
    result = run_make()
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines() == [
        "make gpu-check: no NVIDIA GPU on this host (nvidia-smi, which comes with the driver, is "
        "not installed); nothing to check on this host."]
    assert result.stderr == ""


def test_the_module_itself_exits_0_with_one_line_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(G.gpu.shutil, "which", lambda name: None)
    assert G.main([]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("gpu-check: no NVIDIA GPU on this host")


def test_the_dry_run_lists_every_profile_and_every_check_in_order():
    result = run_make("GPU_CHECK_ARGS=--dry-run")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    steps = [line.split("] ", 1)[1].split(":", 1)[0] for line in lines if "] " in line]
    profiles = [line.split("[", 1)[1].split("]", 1)[0] for line in lines if "] " in line]
    assert profiles[0] == "-" and profiles[-1] == "-" and steps[-1] == "report"
    assert [p for p in dict.fromkeys(profiles) if p != "-"] == ["gpu", "gpu-ort-trt", "gpu-trt"]
    gpu_steps = [s for p, s in zip(profiles, steps) if p == "gpu"]
    assert gpu_steps == ["render", "start", "correctness", "runtime", "gpu-tensors", "soak", "perf"]
    assert [s for p, s in zip(profiles, steps) if p == "gpu-ort-trt"] == ["render", "start", "correctness"]
    assert [s for p, s in zip(profiles, steps) if p == "gpu-trt"] == ["render", "engines", "serve"]
    assert "not run: the wheel ships no tensorrt backend" in result.stdout
    assert "pipeline_ensemble" in result.stdout and "perf_analyzer" in result.stdout
    assert lines[-1] == "dry run: nothing was run"


def test_with_a_tensorrt_backend_gpu_trt_is_served_and_compared_too():
    steps = [(s.profile, s.name) for s in G.plan(tensorrt_backend=Path("/x"))]
    assert [n for p, n in steps if p == "gpu-trt"] == ["render", "engines", "start", "correctness"]


def test_the_plan_fits_the_15_minute_budget_without_start_up():
    fixed = (2 * G.LOAD_SECONDS + G.SOAK_SECONDS
                + 2 * len(G.PERF_CONCURRENCY) * 6 * 2)  # perf: 2 models x levels x trials x 2 s
    assert fixed < G.BUDGET_SECONDS / 3  # the rest is start-ups, engine builds, comparisons


def reference(*probs: float) -> np.ndarray:
    full = np.full(10, (1.0 - sum(probs)) / (10 - len(probs)))
    full[: len(probs)] = probs
    return full


def test_the_same_top5_agrees():
    ref = reference(0.4, 0.2, 0.1, 0.08, 0.07)
    problems, flips, worst = G.compare_top_k(ref, np.arange(5), ref[:5] + 1e-4, STRICT)
    assert (problems, flips) == ([], 0) and worst == pytest.approx(1e-4)


def test_a_near_tie_may_flip_and_is_counted():
    ref = reference(0.4, 0.2, 0.1, 0.0951, 0.095)  # ranks 4 and 5 differ by 1e-4
    ids = np.array([0, 1, 2, 4, 3])
    problems, flips, _ = G.compare_top_k(ref, ids, ref[ids], STRICT)
    assert problems == [] and flips == 2


def test_a_flip_past_the_tie_tolerance_fails_with_the_classes_named():
    ref = reference(0.4, 0.2, 0.1, 0.08, 0.05)
    ids = np.array([0, 1, 2, 4, 3])
    problems, flips, _ = G.compare_top_k(ref, ids, ref[ids], STRICT)
    assert flips == 0 and problems[0].startswith("rank 4: class 4 instead of 3")


def test_the_fifth_and_sixth_classes_may_swap_in_a_near_tie():
    ref = reference(0.4, 0.2, 0.1, 0.08, 0.0500, 0.0499)
    ids = np.array([0, 1, 2, 3, 5])
    problems, flips, _ = G.compare_top_k(ref, ids, ref[ids], STRICT)
    assert problems == [] and flips == 1


def test_probabilities_beyond_the_tolerance_fail():
    ref = reference(0.4, 0.2, 0.1, 0.08, 0.07)
    problems, _, worst = G.compare_top_k(ref, np.arange(5), ref[:5] + 0.01, STRICT)
    assert worst == pytest.approx(0.01) and "differ by 0.01" in problems[0]
    assert G.compare_top_k(ref, np.arange(5), ref[:5] + 0.01, G.TOLERANCES["gpu-ort-trt"])[0] == []


def test_tags_compare_per_token_with_near_ties_allowed():
    ref = np.array([[0.6, 0.3, 0.1], [0.45, 0.449, 0.101], [0.2, 0.7, 0.1]])
    ok = G.compare_tags(ref, np.array([0, 1, 1]), np.array([0.6, 0.449, 0.7]), STRICT)
    assert ok[0] == [] and ok[1] == 1
    wrong = G.compare_tags(ref, np.array([1, 0, 1]), np.array([0.3, 0.45, 0.7]), STRICT)
    assert "1 token(s) tagged differently, e.g. token 0: 1 instead of 0" in wrong[0]


def test_the_tolerances_are_ordered_by_precision():
    fp32, fp16 = G.TOLERANCES["gpu"], G.TOLERANCES["gpu-trt"]
    assert fp32.probs < fp16.probs and fp32.tie < fp16.tie and fp32.embedding > fp16.embedding
    assert G.TOLERANCES["gpu-ort-trt"] == fp16
    assert all(t.tie >= t.probs for t in G.TOLERANCES.values())


def test_flat_compares_the_first_and_last_thirds():
    assert G.flat([100, 101, 100, 102, 101, 100], allowed=8) == (True, 0.0)
    grew, growth = G.flat([100, 100, 150, 150, 200, 200], allowed=8)
    assert not grew and growth == 100


def test_the_gpu_tensors_baseline_is_pipeline_with_them_off(tmp_path):
    from tritonlocal import launcher

    repository = launcher.profile_repository("gpu", ROOT / "model_repository", tmp_path, tmp_path / "c")
    G.add_gpu_tensors_off(repository)
    on = configs.parse_pbtxt((repository / "pipeline" / "config.pbtxt").read_text())
    off = configs.parse_pbtxt((repository / G.GPU_TENSORS_OFF / "config.pbtxt").read_text())
    assert on.parameters["gpu_tensors"].string_value == "on"
    assert off.parameters["gpu_tensors"].string_value == "off" and off.name == G.GPU_TENSORS_OFF
    on.parameters["gpu_tensors"].string_value, on.name = "off", G.GPU_TENSORS_OFF
    assert on == off
    model = repository / G.GPU_TENSORS_OFF / "1" / "model.py"
    assert model.resolve() == (repository / "pipeline" / "1" / "model.py").resolve()


def test_the_report_names_the_gpu_and_the_command(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "_STARTED", {})
    monkeypatch.setattr(report, "gpus", lambda: "driver 580.65.06; GPU 0: NVIDIA L4 (23034 MiB)")
    from bench.common import Result

    result = Result("gpu_check", "GPU check", rows=[{"profile": "gpu", "ok": True}],
                                summary=["- `gpu` start: ok"])
    report.write(result, tmp_path, "2.51.0", G._NoSettings())
    text = report.assemble(tmp_path, title="GPU check", generated_by="`make gpu-check`").read_text()
    assert text.startswith("# GPU check\n\nGenerated by `make gpu-check`")
    assert "NVIDIA L4" in text and "GPU instances" in text


@pytest.mark.parametrize("failed", [False, True])
def test_a_run_writes_the_report_and_fails_on_any_failed_check(tmp_path, monkeypatch, failed):
    from tritonlocal import gpu

    monkeypatch.setattr(G, "OUT", tmp_path)
    monkeypatch.setattr(report, "_STARTED", {})
    monkeypatch.setattr(report, "gpus", lambda: "driver 580.65.06; GPU 0: NVIDIA L4 (23034 MiB)")

    def profile(self, name, tmp):
        self.verdict(name, "start", ["it broke"] if failed and name == "gpu" else [], "ready in 1 s")

    monkeypatch.setattr(G.Check, "profile", profile)
    host = gpu.Host("580.65.06", (gpu.Gpu(0, "NVIDIA L4", 23034),))
    assert G.Check(host, ROOT / "model_repository", None).run() == int(failed)
    text = (tmp_path / "REPORT.md").read_text()
    assert "# GPU check" in text and "`gpu-ort-trt` start: ok" in text
    assert ("**FAILED**" in text) == failed
    assert (tmp_path / "gpu_check.csv").read_text().count("\n") == 1 + len(G.PROFILES)


def test_a_profile_that_cannot_start_is_reported_and_the_others_still_run(tmp_path, monkeypatch):
    from tritonlocal import gpu
    from tritonlocal.runtime import LauncherError

    monkeypatch.setattr(G, "OUT", tmp_path)
    monkeypatch.setattr(report, "_STARTED", {})

    def profile(self, name, tmp):
        if name == "gpu":
            raise LauncherError("tritonserver exited (1): model(s) failed to load\nmore")
        self.verdict(name, "start", [], "ready in 1 s")

    monkeypatch.setattr(G.Check, "profile", profile)
    check = G.Check(gpu.Host("580.65.06", (gpu.Gpu(0, "NVIDIA L4", 23034),)), ROOT / "model_repository", None)
    assert check.run() == 1
    assert check.failures == ["gpu run: LauncherError: tritonserver exited (1): model(s) failed to load"]
    assert "`gpu-trt` start: ok" in (tmp_path / "REPORT.md").read_text()
