"""Write an experiment's results (CSV, JSON summary, PNG plot) and assemble bench/results/REPORT.md
from every experiment's latest results, so one experiment can be re-run alone."""

from __future__ import annotations

import csv
import json
import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path

ORDER = ["orchestration", "overload", "ort_options", "control_flow"]


def machine(gpu_build: bool = False) -> dict[str, str]:
    cpu, simd = "unknown", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown":
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not simd:
                # What ONNX Runtime's CPU kernels can use: hosts of the same kind differ here.
                flags = set(line.split(":", 1)[1].split())
                simd = "+".join(f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "amx_tile")
                                if f in flags) or "no avx2"
        memory = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal")) / 2**20
    except (OSError, StopIteration):
        memory = 0.0
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ".", ":!bench/results"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        commit += " + uncommitted changes" if dirty and commit else ""
    except OSError:
        commit = ""
    return {"cpu": f"{cpu} ({simd})" if simd else cpu, "cores": str(os.cpu_count()),
            "memory_gib": f"{memory:.0f}",
            "os": platform.platform(), "python": platform.python_version(), "commit": commit,
            "onnx_backend": onnx_backend(gpu_build), "gpu": gpus()}


def gpus() -> str:
    """The host's GPUs and driver, or "no GPU"."""
    from tritonlocal import gpu

    try:
        return gpu.probe().describe()
    except gpu.NoGpu:
        return "no GPU"


def onnx_backend(gpu_build: bool = False) -> str:
    """What serves the ONNX models in this run: the build `make backend` (or, with
    ``gpu_build``, `make backend-gpu`) made."""
    from tritonlocal import backend_build

    built = backend_build.installed(gpu=gpu_build)
    if built is None:
        return "no onnxruntime backend built"
    info = json.loads((built.parent / "build-info.json").read_text())
    return (f"Triton's onnxruntime backend {info['tag']} (C++, built here"
            f"{', GPU build: CUDA 13, onnxruntime-gpu' if gpu_build else ''}) on ONNX Runtime "
            f"{info['library']['version']}")


_STARTED: dict[str, str] = {}


def started(gpu_build: bool = False) -> dict[str, str]:
    """The machine and commit as of the first call (``python -m bench`` calls it before it
    measures), so later edits to the tree are not attributed to this run."""
    if not _STARTED:
        _STARTED.update(machine(gpu_build))
    return dict(_STARTED)


def write(result, out: Path, triton_version: str, settings) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if result.rows:
        fields = list(dict.fromkeys(k for row in result.rows for k in row))
        with (out / f"{result.name}.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=fields)
            writer.writeheader()
            writer.writerows(result.rows)
    figures = {}
    for suffix, (title, draw) in result.figures.items():
        draw(out / f"{result.name}-{suffix}.png")
        figures[f"{result.name}-{suffix}.png"] = title
    meta = {"name": result.name, "title": result.title, "summary": result.summary,
            "figures": figures,
            "commands": result.commands, "data": result.data, "triton": triton_version,
            "quick": settings.quick,
            "settings": vars(settings), "machine": started(),
            "when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    (out / f"{result.name}.json").write_text(json.dumps(meta, indent=2) + "\n")
    if result.plot and result.rows:
        plot(result, out / f"{result.name}.png")


def plot(result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result.rows
            if all(r.get(k) == v for k, v in (result.plot.get("filter") or {}).items())]
    facet = result.plot.get("facet")
    if result.plot["kind"] == "curve" and facet:
        groups = list(dict.fromkeys(r.get(facet) for r in rows))
        fig, axes = plt.subplots(len(groups), 1, figsize=(9, 4.5 * len(groups)), squeeze=False)
        for ax, group in zip(axes[:, 0], groups):
            _curves(ax, [r for r in rows if r.get(facet) == group])
            ax.set_title(f"{result.plot['title']}: {group}")
            ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    if result.plot["kind"] == "curve":
        _curves(ax, rows)
    else:
        # A variant measured in several rounds is one bar: the median of its values (p50 unless
        # the plot names another column, and the bars' labels).
        value = result.plot.get("value", "p50_ms")
        keys = result.plot.get("label", ["variant"])
        by_label: dict[str, list[float]] = {}
        for r in rows:
            label = ", ".join(str(r[k]) for k in keys).replace("`", "")
            by_label.setdefault(label, []).append(float(r[value]))
        labels = [label + (f" (median of {len(v)})" if len(v) > 1 else "")
                  for label, v in by_label.items()]
        ax.barh(labels, [sorted(v)[len(v) // 2] for v in by_label.values()])
        ax.set_xlabel(result.plot.get("xlabel", "p50 latency (ms)"))
        ax.invert_yaxis()
        fig.subplots_adjust(left=0.45)
    ax.set_title(result.plot["title"])
    ax.grid(True, alpha=0.3)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _curves(ax, rows: list[dict]) -> None:
    """Throughput against p95, one line per variant, each point labelled with its concurrency."""
    for variant in dict.fromkeys(r["variant"] for r in rows):
        series = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["concurrency"])
        ax.plot([r["p95_ms"] for r in series], [r["throughput"] for r in series], marker="o",
                label=variant)
        for r in series:
            ax.annotate(str(r["concurrency"]), (r["p95_ms"], r["throughput"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("p95 latency (ms)")
    ax.set_ylabel("throughput (inferences/s)")
    ax.set_xscale("log")
    ax.legend(fontsize=7)


def _separate_tables(lines: list[str]) -> list[str]:
    """A blank line wherever a markdown table starts or ends next to other text."""
    result: list[str] = []
    for line in lines:
        if result and result[-1] and line and result[-1].startswith("|") != line.startswith("|"):
            result.append("")
        result.append(line)
    return result


def assemble(out: Path, title: str = "Benchmark report",
             generated_by: str = "`make bench` (`python -m bench`)") -> Path:
    metas = {}
    for path in out.glob("*.json"):
        meta = json.loads(path.read_text())
        if "name" in meta and "summary" in meta:  # an experiment's (soak.json is the soak's own)
            metas[meta["name"]] = meta
    names = [n for n in ORDER if n in metas] + sorted(set(metas) - set(ORDER))
    lines = [f"# {title}", "",
             f"Generated by {generated_by} from the CSV/JSON files beside this one; "
             "each section says when it was measured. Do not edit: re-run the benchmark. What each "
             "missed target comes from, and the next step: "
             "[docs/benchmarks.md](../../docs/benchmarks.md#results-met-missed-and-why).", ""]
    if names:
        first = metas[names[0]]
        m = first["machine"]
        lines += ["| | |", "|---|---|",
                  f"| hardware | {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, "
                  f"{m.get('gpu', 'no GPU')} |",
                  f"| software | Triton {first['triton']} (nvidia-pytriton wheel), "
                  f"{'CPU' if m.get('gpu', 'no GPU') == 'no GPU' else 'GPU'} instances, "
                  f"{m.get('onnx_backend', 'the Python stand-in onnxruntime backend')}; "
                  f"Python {m['python']}; {m['os']} |",
                  f"| client | on the same machine as the server (it competes for the {m['cores']} cores) |",
                  "| protocol | gRPC unless a row says otherwise; perf_analyzer from tritonclient 2.50.0 |",
                  "", "Absolute figures differ between hosts of this kind by up to 2× (the same "
                  "classifier measured 3.5 and 7 ms per image on two of them); the ratios, each "
                  "measured side by side in one run, are what carries over.", ""]
    for name in names:
        meta = metas[name]
        quick = " — **quick smoke settings, not a measurement**" if meta["quick"] else ""
        lines += [f"## {meta['title']}", "",
                  f"Measured {meta['when']} at commit `{meta['machine']['commit']}`{quick}"
                  + (f" on {meta['machine']['cpu']}" if meta["machine"]["cpu"] != m["cpu"] else "")
                  + (f" with {meta['machine'].get('onnx_backend', 'the Python stand-in backend')}"
                     if meta["machine"].get("onnx_backend") != m.get("onnx_backend") else "")
                  + ". "
                  f"Data: [`{name}.csv`]({name}.csv).", ""]
        lines += _separate_tables(meta["summary"]) + [""]
        if (out / f"{name}.png").exists():
            lines += [f"![{meta['title']}]({name}.png)", ""]
        for file, title in meta.get("figures", {}).items():
            if (out / file).exists():
                lines += [f"![{title}]({file})", ""]
        if meta["commands"]:
            lines += ["<details><summary>perf_analyzer command lines</summary>", "", "```"]
            lines += list(dict.fromkeys(meta["commands"])) + ["```", "", "</details>", ""]
    report = out / "REPORT.md"
    report.write_text("\n".join(lines))
    return report
