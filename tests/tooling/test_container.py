"""The container path, checked as far as a machine without Docker or a GPU allows: the
Dockerfile's image tag, user, health check and COPY sources; the entry script's dry run for every
profile; every GPU-profile config through Triton's protobuf and the orchestrators' own stage
check; the TensorRT engine plan in dry-run mode. Nothing here builds or runs the image."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2

from bls_models import spec as S
from modelgen import configs, profiles
from tritonlocal import flags

ROOT = Path(__file__).resolve().parents[2]
# The dry runs' credential, so their commands are known.
TOKEN_SPEC = "triton-admin-key=t0ken" + "0" * 32
DOCKERFILE = (ROOT / "Dockerfile").read_text()
IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"
KIND = model_config_pb2.ModelInstanceGroup.Kind


def stages(text: str) -> dict[str, list[str]]:
    """Dockerfile stage name -> its instructions (continuation lines joined)."""
    joined = re.sub(r"\\\n\s*", " ", text)
    result, current = {}, None
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            match = re.search(r"\bAS\s+(\S+)", line, flags=re.IGNORECASE)
            current = match.group(1) if match else f"stage{len(result)}"
            result[current] = []
        if current:
            result[current].append(line)
    return result


def test_the_dockerfile_and_the_readme_name_the_same_triton_image():
    assert f"ARG TRITON_IMAGE={IMAGE}" in DOCKERFILE
    readme = (ROOT / "README.md").read_text()
    assert IMAGE in readme
    assert set(re.findall(r"nvcr\.io/nvidia/tritonserver:[\w.-]+", readme)) == {IMAGE}


@pytest.mark.parametrize("stage", ["server", "test"])
def test_each_image_runs_as_a_non_root_user_with_an_entry_point(stage):
    instructions = stages(DOCKERFILE)[stage]
    users = [i.split()[1] for i in instructions if i.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root"), users
    last_user = max(n for n, i in enumerate(instructions) if i.startswith("USER "))
    assert any(i.startswith("ENTRYPOINT") for i in instructions[last_user:]), "runs as root"
    assert users[-1].split(":")[0] == "10001"


NGC_ENTRYPOINT = "/opt/nvidia/nvidia_entrypoint.sh"


@pytest.mark.parametrize("stage, script", [("server", "container-serve.sh"),
                                           ("test", "container-test.sh")])
def test_each_image_starts_through_ngcs_entry_point_then_its_script(stage, script):
    """NGC's entry point sets up CUDA forward compatibility (older drivers), then execs its
    arguments: the project's script must come after it, not instead of it."""
    import json

    (entrypoint,) = [i for i in stages(DOCKERFILE)[stage] if i.startswith("ENTRYPOINT")][-1:]
    argv = json.loads(entrypoint.removeprefix("ENTRYPOINT"))  # exec form: no shell in between
    assert argv == [NGC_ENTRYPOINT, f"/opt/bls/scripts/{script}"]
    assert (ROOT / "scripts" / script).stat().st_mode & 0o111, f"{script} is not executable"


def test_the_server_image_has_a_readiness_health_check_and_the_served_ports():
    server = stages(DOCKERFILE)["server"]
    health = [i for i in server if i.startswith("HEALTHCHECK")]
    assert health and "/v2/health/ready" in health[0]
    exposed = {int(p) for i in server if i.startswith("EXPOSE") for p in i.split()[1:]}
    ports = {int(f.split("=")[1]) for f in flags.container_flags(flags.new_credential())
             if f.split("=")[0].endswith("-port")}
    assert exposed == ports == {8000, 8001, 8002}
    assert any("container-serve.sh" in i for i in server if i.startswith("ENTRYPOINT"))


def test_every_copy_source_exists_and_no_secret_is_baked_in():
    for instruction in re.sub(r"\\\n\s*", " ", DOCKERFILE).splitlines():
        parts = instruction.split()
        if parts and parts[0] == "COPY" and not any(p.startswith("--from") for p in parts):
            for source in parts[1:-1]:
                assert (ROOT / source).exists(), f"COPY {source}: no such file in the repository"
        if parts and parts[0] in ("ENV", "ARG"):
            assert not re.search(r"(?i)(key|token|password|secret)\s*=", instruction), instruction


def entry_script(profile: str, cache: Path, run_dir: Path, repository: Path,
                 *args: str, env: dict[str, str | None] | None = None,
                 ok: bool = True) -> subprocess.CompletedProcess:
    """``scripts/container-serve.sh`` in dry-run mode, the venv's interpreter standing in for the
    image's python3."""
    python_dir = Path(sys.executable).parent
    if not (python_dir / "python3").exists():
        pytest.skip("no python3 beside the test interpreter")
    env = {**os.environ, "BLS_HOME": str(ROOT), "BLS_CACHE": str(cache), "BLS_PROFILE": profile,
           "BLS_DRY_RUN": "1", "BLS_MODEL_REPOSITORY": str(repository), "BLS_RUN_DIR": str(run_dir),
           "PATH": f"{python_dir}:{os.environ['PATH']}", "TRITONLOCAL_ADMIN_HEADER": TOKEN_SPEC,
           "TRITONLOCAL_OPEN_APIS": None, **(env or {})}
    env = {k: v for k, v in env.items() if v is not None}
    done = subprocess.run(["bash", str(ROOT / "scripts/container-serve.sh"), *args],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == (0 if ok else 2), done.stdout + done.stderr
    return done


def restricted(command: list[str]) -> dict[str, str]:
    """--http-restricted-api / --grpc-restricted-protocol flags of a command: flag -> rule."""
    return {f.split("=", 1)[0]: f.split("=", 1)[1] for f in command
            if f.startswith(("--http-restricted-api=", "--grpc-restricted-protocol="))}


ALL_APIS = ",".join(flags.RESTRICTED_APIS)


@pytest.mark.parametrize("admin", [None, "triton-admin-key=s3cret" + "x" * 32])
def test_the_container_restricts_every_admin_api(tmp_path, repository, admin):
    """Every admin API answers only the operator's credential or, without one, a credential made
    at start, written to a file only its user can read, and handed to the reload watcher. The
    dry run prints the command without the credential's value."""
    env = {"TRITONLOCAL_ADMIN_HEADER": admin, "BLS_ADMIN_FILE": str(tmp_path / "admin.header")}
    run = entry_script("portable", tmp_path / "cache", tmp_path / "run", repository, env=env)
    command = run.stdout.strip().splitlines()[-1].split()
    assert "--model-control-mode=explicit" in command and "--load-model=*" in command
    rule = restricted(command)
    assert set(rule) == {"--http-restricted-api", "--grpc-restricted-protocol"}
    assert set(rule.values()) == {f"{ALL_APIS}:triton-admin-key={flags.REDACTED}"}
    if admin is None:
        written = tmp_path / "admin.header"
        assert written.stat().st_mode & 0o777 == 0o600
        name, value = flags.read_credential(written)
        assert name == flags.ADMIN_HEADER and re.fullmatch(r"[0-9a-f]{64}", value)
        assert value not in run.stdout + run.stderr
        assert f"in {written}" in run.stderr
    else:
        assert not (tmp_path / "admin.header").exists()
        assert "s3cret" not in run.stdout + run.stderr


def test_an_opened_api_is_left_out_of_the_rules_with_a_warning(tmp_path, repository):
    env = {"TRITONLOCAL_OPEN_APIS": "logging,trace"}
    run = entry_script("portable", tmp_path / "cache", tmp_path / "run", repository, env=env)
    rule = restricted(run.stdout.strip().splitlines()[-1].split())
    assert set(rule.values()) == {f"model-repository,shared-memory:triton-admin-key={flags.REDACTED}"}
    warned = [line for line in run.stderr.splitlines() if line.startswith("warning:")]
    assert len(warned) == 2 and "logging API is open" in warned[0] and "trace" in warned[1]


@pytest.mark.parametrize("admin,why", [("triton-admin-key=REPLACE-ME", "at least 32"),
                                       ("no-equals-sign" + "x" * 40, "needs a name"),
                                       (None, "unknown admin API")])
def test_the_entry_script_refuses_a_bad_credential_or_api_name(tmp_path, repository, admin, why):
    """The Kubernetes Secret's placeholder, a value with no name, or a misspelt API to open: the
    container does not start, and says why in one line."""
    env = {"TRITONLOCAL_ADMIN_HEADER": admin, "TRITONLOCAL_OPEN_APIS": "loging" if admin is None
           else None}
    run = entry_script("portable", tmp_path / "cache", tmp_path / "run", repository, env=env,
                       ok=False)
    assert why in run.stderr and "tritonserver" not in run.stdout
    assert "REPLACE-ME" not in run.stdout + run.stderr


def test_a_credential_is_new_at_every_start(tmp_path):
    made = [flags.main(["--new-credential", str(tmp_path / f"c{i}")]) for i in range(2)]
    assert made == [0, 0]
    values = [flags.read_credential(tmp_path / f"c{i}")[1] for i in range(2)]
    assert all(re.fullmatch(r"[0-9a-f]{64}", v) for v in values)
    assert values[0] != values[1], "the same credential twice"


FAKE_PYTHON = """#!/bin/sh
# The watcher records what it was given and ends; any other python3 call is the real one.
if [ "$1 $2" = "-m tritonlocal.reload" ]; then
  env > "$FAKE_OUT/watcher.env"; exit 0
fi
exec {python} "$@"
"""
FAKE_SERVER = """#!/bin/sh
env > "$FAKE_OUT/server.env"; printf '%s\\n' "$@" > "$FAKE_OUT/server.argv"
"""


# ids: pytest puts the test's id in the environment (PYTEST_CURRENT_TEST), the value must not be.
@pytest.mark.parametrize("admin", [None, "triton-admin-key=s3cretXYZ" + "0" * 32],
                         ids=["generated", "admin"])
def test_the_header_reaches_tritonserver_on_its_argv_and_the_watcher_alone_in_its_environment(
        tmp_path, repository, admin):
    """A real start, with stand-ins for tritonserver and the watcher: the header is in the
    server's argv (r24.10 takes it there only) and the watcher's environment, never in the
    server's environment (every stub inherits it) nor in anything printed."""
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, text in (("python3", FAKE_PYTHON.format(python=Path(sys.executable).parent / "python3")),
                       ("tritonserver", FAKE_SERVER)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = {"BLS_DRY_RUN": "0", "FAKE_OUT": str(out), "TRITONLOCAL_ADMIN_HEADER": admin,
           "PATH": f"{fake}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    run = entry_script("portable", tmp_path / "cache", tmp_path / "run", repository, env=env)
    argv = (out / "server.argv").read_text().splitlines()
    header = restricted(argv)["--http-restricted-api"].split(":", 1)[1]
    if admin is None:
        assert re.fullmatch(r"triton-admin-key=[0-9a-f]{64}", header), header
    else:
        assert header == admin
    value = header.split("=", 1)[1]
    server_env = (out / "server.env").read_text()
    assert value not in server_env
    assert not re.search(r"(?m)^TRITONLOCAL_ADMIN_HEADER=", server_env)
    watcher_env = dict(line.split("=", 1) for line in
                       (out / "watcher.env").read_text().splitlines() if "=" in line)
    assert watcher_env.get("TRITONLOCAL_ADMIN_HEADER") == header
    assert value not in run.stdout + run.stderr


def served_repository(command: list[str]) -> Path:
    (flag,) = [f for f in command if f.startswith("--model-repository=")]
    return Path(flag.split("=", 1)[1])


@pytest.mark.parametrize("profile", ["portable", *profiles.PROFILES])
def test_the_entry_script_dry_run_renders_the_profile_and_the_command(profile, tmp_path, repository):
    done = entry_script(profile, tmp_path / "cache", tmp_path / "run", repository, "--log-verbose=1")
    command = done.stdout.strip().splitlines()[-1].split()
    served = served_repository(command)
    if profile == "portable":
        assert served == repository
    else:  # rendered into a directory of this container's own, outside the shared cache
        assert served.parent == tmp_path / "run"
        assert re.fullmatch(rf"repository-{profile}\.\w{{6}}", served.name), served.name
        assert (served / "pipeline" / "config.pbtxt").is_file()
    assert command[0] == "tritonserver" and command[-1] == "--log-verbose=1"
    assert command[1:-1] == flags.redact(flags.container_flags(flags.parse_header(TOKEN_SPEC),
                                                              str(served)))
    assert "t0ken" not in done.stdout + done.stderr
    assert "beside it: python3 -m tritonlocal.reload" in done.stderr
    if profile == "gpu-trt":
        assert "classifier_trt" in done.stderr and "nothing built" in done.stderr


def test_the_container_server_gets_a_cuda_memory_pool_per_gpu_of_the_documented_size(tmp_path,
                                                                                  repository):
    """Triton's 64 MiB default holds fewer than 7 batch-16 PIXELS (9.6 MB each); past it, every
    GPU tensor of a BLS request or response is a cudaMalloc/cudaFree with its own IPC handle."""
    size = flags.CUDA_MEMORY_POOL_BYTES
    assert size == profiles.cuda_pool_bytes() == 256 * 2**20
    need = sum(profiles.cuda_pool_need().values())
    assert 64 * 2**20 < need < size
    docs = " ".join((ROOT / "docs" / "production.md").read_text().split())
    assert "--cuda-memory-pool-byte-size" in docs and f"{need:,} bytes" in docs
    assert f"{size // 2**20} MiB" in docs
    expected = [f"--cuda-memory-pool-byte-size={gpu}:{size}" for gpu in range(flags.CUDA_POOL_GPUS)]
    done = entry_script("gpu", tmp_path / "cache", tmp_path / "run", repository)
    command = done.stdout.split()
    assert [f for f in command if f.startswith("--cuda-memory-pool-byte-size")] == expected
    # Only the container's server: the local one has no GPU.
    assert not any(f.startswith("--cuda") for f in flags.serving_flags())


def test_the_cuda_pool_arithmetic_counts_every_gpu_copy_of_pixels():
    pixels = 3 * S.IMAGE_SIZE * S.IMAGE_SIZE * 4
    need = profiles.cuda_pool_need()
    rows = {m: profiles.GPU_INSTANCES[m] * S.model(m).max_batch_size * 2
            for m in ("classifier", "embedder")}
    assert need["bls_inputs"] == (rows["classifier"] + rows["embedder"]) * pixels
    assert need["bls_outputs"] == max(rows.values()) * pixels


def test_containers_sharing_a_cache_each_serve_a_repository_of_their_own(tmp_path, repository):
    """Two containers (or pods) on one cache volume: the second start must not delete or rewrite
    the repository the first one's server is reading."""
    cache, run = tmp_path / "shared-cache", tmp_path / "run"
    first = served_repository(entry_script("gpu-ort-trt", cache, run, repository).stdout.split())
    before = {p: p.read_text() for p in first.glob("*/config.pbtxt")}
    second = served_repository(entry_script("gpu-ort-trt", cache, run, repository).stdout.split())
    assert first != second
    assert {p: p.read_text() for p in first.glob("*/config.pbtxt")} == before
    assert len(before) == len(list(second.glob("*/config.pbtxt"))) == len(profiles.profile_models(
        "gpu-ort-trt"))
    assert not list(cache.glob("repository-*")), "nothing rendered into the shared cache"
    # What they do share: ONNX Runtime's engine cache directories.
    assert (cache / "ort-trt" / "classifier").is_dir()


def test_an_unknown_profile_is_refused():
    done = subprocess.run(["bash", str(ROOT / "scripts/container-serve.sh")],
                          env={**os.environ, "BLS_PROFILE": "tpu", "BLS_DRY_RUN": "1"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "BLS_PROFILE must be" in done.stderr


def test_docker_run_and_test_container_use_separate_cache_volumes():
    makefile = (ROOT / "Makefile").read_text()
    variables = dict(re.findall(r"(?m)^(\w+)\s*\?=\s*(\S+)", makefile))
    recipes = {target: body for target, body in re.findall(
        r"(?ms)^([\w-]+):[^\n]*\n((?:\t[^\n]*\n)+)", makefile)}
    mounts = {target: re.findall(r"-v \$\((\w+)\):/var/cache/bls", recipes[target])
              for target in ("docker-run", "test-container")}
    assert mounts == {"docker-run": ["CACHE_VOLUME"], "test-container": ["TEST_CACHE_VOLUME"]}
    assert variables["CACHE_VOLUME"] != variables["TEST_CACHE_VOLUME"]


def test_docker_run_passes_the_admin_settings_by_name_only():
    """``-e NAME`` takes the host's value if set and puts no value on docker's command line (which
    every local user can read); nothing else of the recipe may carry a credential."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"(?ms)^docker-run:[^\n]*\n((?:\t[^\n]*\n)+)", makefile).group(1)
    passed = re.findall(r"-e (TRITONLOCAL_\w+)(=?)", recipe)
    assert sorted(passed) == [("TRITONLOCAL_ADMIN_HEADER", ""), ("TRITONLOCAL_OPEN_APIS", "")]
    assert flags.ADMIN_HEADER not in recipe and "restricted" not in recipe


def test_the_container_test_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts/container-test.sh")]).returncode == 0


@pytest.mark.parametrize("profile", profiles.PROFILES)
def test_every_gpu_profile_config_parses_and_meets_the_orchestrators_stage_check(profile, tmp_path,
                                                                                repository):
    cache = tmp_path / "cache"
    problems = profiles.write(profile, repository, tmp_path / profile, cache=str(cache))
    assert problems == []
    for model in profiles.profile_models(profile):
        config = configs.parse_pbtxt((tmp_path / profile / model.name / "config.pbtxt").read_text())
        assert config.name == model.name and config.max_batch_size == model.max_batch_size
        assert [t.name for t in config.input] == [t.name for t in model.inputs]
        kinds = {g.kind for g in config.instance_group}
        if model.backend == "python":
            assert kinds == {KIND.Value("KIND_CPU")}, model.name
        elif model.platform != "ensemble":
            assert kinds == {KIND.Value("KIND_GPU")}, model.name
        accelerators = config.optimization.execution_accelerators.gpu_execution_accelerator
        if profile == "gpu-ort-trt" and model.backend == "onnxruntime":
            (trt,) = accelerators
            assert trt.name == "tensorrt" and trt.parameters["precision_mode"] == "FP16"
            assert trt.parameters["trt_engine_cache_path"] == f"{cache}/ort-trt/{model.name}"
            assert set(trt.parameters) <= ORT_TRT_ACCELERATOR_KEYS, model.name
        else:
            assert not accelerators
        if model.backend == "onnxruntime":  # thread counts decided for GPU instances, not CPU's
            threads = {k: config.parameters[k].string_value for k in profiles.GPU_ORT_PARAMETERS}
            assert threads == profiles.GPU_ORT_PARAMETERS, model.name
    pipeline = configs.parse_pbtxt((tmp_path / profile / "pipeline" / "config.pbtxt").read_text())
    classifier = pipeline.parameters["classifier_model"].string_value
    assert classifier == ("classifier_trt" if profile == "gpu-trt" else "classifier")


# The TensorRT accelerator parameters onnxruntime_backend r24.10 accepts (src/onnxruntime.cc; any
# other key fails the model's load with "unknown parameter ... for TensorRT Execution
# Accelerator"). Only the ones the profiles may use are listed.
ORT_TRT_ACCELERATOR_KEYS = {"precision_mode", "max_workspace_size_bytes", "trt_engine_cache_enable",
                            "trt_engine_cache_path", "trt_profile_min_shapes",
                            "trt_profile_opt_shapes", "trt_profile_max_shapes"}
# ONNX Runtime's format for the profile shapes: NAME:dxdxd, one entry per input, comma-separated.
PROFILE_SHAPES = re.compile(r"^\w+:\d+(x\d+)*(,\w+:\d+(x\d+)*)*$")


def test_rendering_gpu_ort_trt_creates_its_engine_cache_directories(tmp_path, repository):
    """ONNX Runtime's TensorRT provider creates only the last level of trt_engine_cache_path and
    fails the load otherwise; the instances of a model load in parallel and would race for it."""
    cache = tmp_path / "fresh-cache"
    profiles.write("gpu-ort-trt", repository, tmp_path / "repo", cache=str(cache))
    onnx_models = [m.name for m in S.ONNX_MODELS]
    for name in onnx_models:
        config = configs.parse_pbtxt((tmp_path / "repo" / name / "config.pbtxt").read_text())
        (trt,) = config.optimization.execution_accelerators.gpu_execution_accelerator
        assert Path(trt.parameters["trt_engine_cache_path"]).is_dir(), name
    assert sorted(p.name for p in (cache / "ort-trt").iterdir()) == sorted(onnx_models)
    # Rendering again (a restart, or another container on the same cache) is fine.
    profiles.write("gpu-ort-trt", repository, tmp_path / "repo", cache=str(cache))
    # The other profiles set no engine cache path and create nothing.
    for profile in ("gpu", "gpu-trt"):
        profiles.write(profile, repository, tmp_path / profile, cache=str(tmp_path / profile / "c"))
        assert not (tmp_path / profile / "c").exists(), profile


@pytest.mark.parametrize("model", S.ONNX_MODELS, ids=lambda m: m.name)
def test_gpu_ort_trt_builds_each_engine_at_load_for_batch_1_to_max(model):
    """Explicit min/opt/max shapes for every input: ONNX Runtime builds the engine when the
    session is created (model load, inside the startup probe), not on the first request, and
    never again for a larger batch."""
    (trt,) = profiles.profile_config(model, "gpu-ort-trt", "/c")["optimization"][
        "execution_accelerators"]["gpu_execution_accelerator"]
    params = trt["parameters"]
    shapes = {which: params[f"trt_profile_{which}_shapes"] for which in ("min", "opt", "max")}
    for value in shapes.values():
        assert PROFILE_SHAPES.match(value), value
    dims = "x".join(map(str, model.inputs[0].dims))
    opt = max(model.batching.preferred_batch_sizes)
    name = model.inputs[0].name
    assert len(model.inputs) == 1, "one entry per input: extend the expectation below"
    assert shapes == {"min": f"{name}:1x{dims}", "opt": f"{name}:{opt}x{dims}",
                      "max": f"{name}:{model.max_batch_size}x{dims}"}
    assert 1 <= opt <= model.max_batch_size


def test_the_classifiers_tensorrt_profile_is_spelled_as_onnx_runtime_reads_it():
    params = profiles.trt_profile_shapes(S.CLASSIFIER)
    assert params == {"trt_profile_min_shapes": "PIXELS:1x3x224x224",
                      "trt_profile_opt_shapes": "PIXELS:16x3x224x224",
                      "trt_profile_max_shapes": "PIXELS:16x3x224x224"}


@pytest.mark.parametrize("profile", profiles.PROFILES)
def test_gpu_models_warm_up_every_batch_size_before_the_server_is_ready(profile, tmp_path, repository):
    """Every ONNX and TensorRT model of a GPU profile warms each batch size it can be given
    (ONNX Runtime's CUDA provider searches convolution algorithms per new input shape), with
    samples Triton accepts: each config input, its type and dims, one data source, a batch
    within max_batch_size. Orchestrators and the ensemble have none."""
    profiles.write(profile, repository, tmp_path / profile, cache=str(tmp_path / "cache"))
    for model in profiles.profile_models(profile):
        config = configs.parse_pbtxt((tmp_path / profile / model.name / "config.pbtxt").read_text())
        if model.backend != "onnxruntime" and model.platform != "tensorrt_plan":
            assert not config.model_warmup, model.name
            continue
        assert [w.batch_size for w in config.model_warmup] == list(range(1, config.max_batch_size + 1))
        for sample in config.model_warmup:
            assert set(sample.inputs) == {t.name for t in config.input}, model.name
            for tensor in config.input:
                warm = sample.inputs[tensor.name]
                assert (warm.data_type, list(warm.dims)) == (tensor.data_type, list(tensor.dims))
                assert warm.WhichOneof("input_data_type") == "zero_data" and warm.zero_data


def test_the_committed_portable_configs_have_no_warmup(repository):
    """Warm-up is for the GPU profiles; the committed configs also serve the local CPU server."""
    for path in sorted(repository.glob("*/config.pbtxt")):
        assert not configs.parse_pbtxt(path.read_text()).model_warmup, path


def test_warmup_runs_per_gpu_are_the_documented_count():
    runs = sum(profiles.GPU_INSTANCES[m.name] * m.max_batch_size for m in S.ONNX_MODELS)
    assert runs == 200
    docs = " ".join((ROOT / "docs" / "production.md").read_text().split())
    assert "200 warm-up executions per GPU" in docs


def test_trt_optimisation_shapes_come_from_the_spec():
    shapes = profiles.optimisation_shapes(S.CLASSIFIER)
    dims = S.CLASSIFIER.inputs[0].dims
    assert shapes == {"PIXELS": ((1, *dims), (max(S.CLASSIFIER.batching.preferred_batch_sizes), *dims),
                                 (S.CLASSIFIER.max_batch_size, *dims))}


def test_the_engine_build_dry_run_plans_every_trt_model(tmp_path, repository):
    repo = tmp_path / "gpu-trt"
    profiles.write("gpu-trt", repository, repo)
    done = subprocess.run([sys.executable, str(ROOT / "scripts/build_trt_engines.py"), "--repository",
                           str(repo), "--cache", str(tmp_path / "engines"), "--dry-run"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for name in profiles.TRT_MODELS:
        assert f"{name}_trt: " in done.stdout
    assert "configs and ONNX files agree" in done.stdout
    assert not (tmp_path / "engines").exists(), "a dry run builds nothing"


def build_script():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import build_trt_engines
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return build_trt_engines


def test_an_engine_is_written_through_a_temporary_file_of_its_own_then_renamed(tmp_path, monkeypatch):
    """Containers sharing the engine cache may build the same engine at once: each writes its own
    temporary file (never a fixed `<name>.partial`) and renames it over the engine."""
    build = build_script()
    renames = []
    real_replace = os.replace
    monkeypatch.setattr(build.os, "replace",
                        lambda src, dst: (renames.append((Path(src), Path(dst))), real_replace(src, dst)))
    target = tmp_path / "engines" / "classifier_trt-0123456789abcdef.plan"
    build.publish(target, b"first engine")
    build.publish(target, b"second engine")
    assert target.read_bytes() == b"second engine"
    (src1, dst1), (src2, dst2) = renames
    assert dst1 == dst2 == target and src1 != src2
    assert src1.parent == src2.parent == target.parent  # a rename, never a copy across devices
    assert src1.name.endswith(".partial") and src1.name != target.with_suffix(".partial").name
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name], "temporaries left"
    assert target.stat().st_mode & 0o777 == 0o644


def test_an_engine_write_that_fails_leaves_the_cached_engine_and_no_temporary(tmp_path, monkeypatch):
    build = build_script()
    target = tmp_path / "model.plan"
    build.publish(target, b"good engine")

    def crash(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(build.os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        build.publish(target, b"half an engine")
    assert target.read_bytes() == b"good engine"
    assert [p.name for p in tmp_path.iterdir()] == ["model.plan"]


def test_concurrent_engine_writes_leave_one_whole_engine(tmp_path):
    import threading

    build = build_script()
    target = tmp_path / "model.plan"
    engines = [bytes([n]) * (4 * 2**20) for n in range(4)]
    threads = [threading.Thread(target=build.publish, args=(target, e)) for e in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert target.read_bytes() in engines
    assert [p.name for p in tmp_path.iterdir()] == ["model.plan"]


def test_the_engine_build_refuses_a_config_that_disagrees_with_the_spec(tmp_path, repository):
    repo = tmp_path / "gpu-trt"
    profiles.write("gpu-trt", repository, repo)
    config = repo / "classifier_trt" / "config.pbtxt"
    config.write_text(config.read_text().replace("dims: 224", "dims: 256", 1))
    done = subprocess.run([sys.executable, str(ROOT / "scripts/build_trt_engines.py"), "--repository",
                           str(repo), "--dry-run"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "differ from classifier's spec" in done.stderr


def requirement_arrays(text: str) -> dict[str, list[str]]:
    """The ``key = [ "requirement", ... ]`` arrays of pyproject.toml, on one line or closed by a
    ``]`` at the start of a line: what these tests need of TOML. This suite also runs in the
    image, whose Python 3.10 has no ``tomllib``."""
    text = re.sub(r"(?m)#.*$", "", text)  # comments (the file has no '#' inside strings)
    arrays = re.findall(r"(?ms)^([\w-]+)\s*=\s*\[([^\n]*?)\]\s*$"
                        r"|^([\w-]+)\s*=\s*\[\s*\n(.*?)^\]", text)
    return {one_key or key: re.findall(r'"([^"]+)"', one_body or body)
            for one_key, one_body, key, body in arrays}


def test_the_requirement_reader_agrees_with_tomllib_where_there_is_one():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+: here, not in the image
    text = (ROOT / "pyproject.toml").read_text()
    project = tomllib.loads(text)["project"]
    arrays = requirement_arrays(text)
    assert arrays["dependencies"] == project["dependencies"]
    for extra, requirements in project["optional-dependencies"].items():
        assert arrays[extra] == requirements, extra


def test_the_pinned_container_requirements_exist_for_the_images_python():
    """Pins that must match the NGC 24.10 image (Python 3.10, TensorRT 10.5, numpy < 2)."""
    arrays = requirement_arrays((ROOT / "pyproject.toml").read_text())
    pins = {re.split(r"[=<>\[]", d)[0]: d for d in arrays["dependencies"] + arrays["container"]}
    assert pins["numpy"] == "numpy==1.26.4"
    assert pins["tensorrt-cu12-bindings"].endswith("==10.5.0")


# -- Python 3.10, the image's ----------------------------------------------------------------------
IMAGE_PYTHON = (3, 10)
# The standard library's additions after 3.10 that this code base could plausibly reach for
# (compiling with 3.10 cannot see them: they fail at import or call time). Best effort, not all.
NEW_MODULES = {"tomllib", "wsgiref.types"}
NEW_NAMES = {("datetime", "UTC"), ("typing", "Self"), ("typing", "LiteralString"),
             ("typing", "Never"), ("typing", "assert_never"), ("typing", "reveal_type"),
             ("typing", "Required"), ("typing", "NotRequired"), ("typing", "TypeVarTuple"),
             ("typing", "Unpack"), ("typing", "dataclass_transform"), ("typing", "override"),
             ("enum", "StrEnum"), ("enum", "ReprEnum"), ("enum", "verify"),
             ("asyncio", "TaskGroup"), ("asyncio", "timeout"), ("asyncio", "timeout_at"),
             ("asyncio", "Runner"), ("asyncio", "Barrier"), ("contextlib", "chdir"),
             ("hashlib", "file_digest"), ("itertools", "batched"), ("operator", "call"),
             ("math", "cbrt"), ("math", "exp2"), ("logging", "getLevelNamesMapping")}
NEW_BUILTINS = {"ExceptionGroup", "BaseExceptionGroup"}


def image_python_files() -> list[Path]:
    """Every .py file the server and test images carry: under each directory the Dockerfile
    COPYs from the build context, and the exported repository's model.py files."""
    sources = {source for stage in ("export", "server", "test") for instruction in stages(DOCKERFILE)[stage]
               if instruction.startswith("COPY ") and "--from" not in instruction
               for source in instruction.split()[1:-1]}
    files = {f for source in sources if (ROOT / source).is_dir()
             for f in (ROOT / source).rglob("*.py") if "__pycache__" not in f.parts}
    return sorted(files)


def newer_than_the_image(source: str, name: str) -> list[str]:
    """Uses of the standard library's post-3.10 additions in ``source`` (the file ``name``)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name in NEW_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in NEW_MODULES:
                found.append(node.module)
            found += [f"{node.module}.{a.name}" for a in node.names
                      if (node.module, a.name) in NEW_NAMES]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in NEW_NAMES:
                found.append(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr == "add_note":
            found.append("BaseException.add_note")
        elif isinstance(node, ast.Name) and node.id in NEW_BUILTINS:
            found.append(node.id)
    return [f"{name}:{use}" for use in found]


def python310() -> str | None:
    """A Python 3.10 interpreter on this machine, if any (``$PYTHON310``, PATH, pyenv)."""
    import glob
    import shutil

    candidates = [os.environ.get("PYTHON310", ""),
                  *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.10*/bin/python3.10"))),
                  shutil.which("python3.10") or ""]  # may be a pyenv shim that refuses to run
    for candidate in filter(None, candidates):
        try:
            version = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2])"],
                                     capture_output=True, text=True, timeout=30).stdout.strip()
        except OSError:
            continue
        if version == str(IMAGE_PYTHON):
            return candidate
    return None


def test_the_images_python_files_include_what_its_scripts_run():
    files = {str(f.relative_to(ROOT)) for f in image_python_files()}
    for expected in ("bls_models/triton_runtime.py", "modelgen/profiles.py", "tritonlocal/flags.py",
                     "scripts/build_trt_engines.py", "scripts/check_image.py",
                     "tests/tooling/test_container.py", "model_repository/pipeline/1/model.py"):
        assert expected in files


def test_every_python_file_the_image_carries_compiles_under_python_3_10():
    """The image's python3 is 3.10: with a real 3.10 here (pyenv), each file is compiled by it;
    otherwise parsed with the 3.10 grammar, which catches less (ast's feature_version)."""
    files = image_python_files()
    interpreter = python310()
    if interpreter:
        script = ("import sys\nfor path in sys.argv[1:]:\n"
                  "    compile(open(path, encoding='utf-8').read(), path, 'exec')\n")
        done = subprocess.run([interpreter, "-c", script, *map(str, files)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    else:
        import ast

        for path in files:
            ast.parse(path.read_text(), str(path), feature_version=IMAGE_PYTHON)


def test_no_python_file_the_image_carries_uses_the_standard_librarys_post_3_10_additions():
    found = [use for path in image_python_files()
             for use in newer_than_the_image(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == [], "not in the image's Python 3.10: " + ", ".join(found)


def test_the_post_3_10_check_finds_what_it_looks_for():
    source = ("import tomllib\nfrom typing import Self\nimport datetime\nnow = datetime.UTC\n"
              "raise ExceptionGroup('x', [])\n")
    found = [use.split(":")[1] for use in newer_than_the_image(source, "sample.py")]
    assert sorted(found) == ["ExceptionGroup", "datetime.UTC", "tomllib", "typing.Self"]


def test_the_image_build_imports_what_the_container_imports():
    server, test = stages(DOCKERFILE)["server"], stages(DOCKERFILE)["test"]
    runs = [i for i in server if i.startswith("RUN ") and "scripts/check_image.py" in i]
    assert runs, "the server image does not check its imports at build time"
    # After the repository (its model.py files) and the scripts are in the image.
    assert server.index(runs[0]) > max(n for n, i in enumerate(server) if i.startswith("COPY "))
    assert any("scripts/check_image.py --test" in i for i in test if i.startswith("RUN "))


def test_the_image_import_check_runs_here(monkeypatch):
    """The check itself (its module lists and file paths), with this Python and without
    TensorRT, which only the image has."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import check_image
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    monkeypatch.setattr(check_image, "tensorrt_version", lambda: "(not here)")
    done = check_image.check(test_image=False)
    assert "bls_models.triton_runtime" in done and "scripts/build_trt_engines.py" in done
    assert "model_repository/pipeline/1/model.py" in done


# -- /dev/shm for the python backend's regions ------------------------------------------------------
def docker_size(value: str) -> int:
    """A ``docker run --shm-size`` value (b, k, m, g: powers of 1024) in bytes."""
    number, unit = re.fullmatch(r"(\d+)([bkmg]?)", value.lower()).groups()
    return int(number) * 1024 ** "bkmg".index(unit or "b")


def makefile_variable(name: str) -> str:
    return re.search(rf"(?m)^{name}\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text()).group(1)


def test_the_shm_budget_is_the_rule_of_the_operations_docs():
    """The rule docs/operations.md states, with the region sizes the servers are started with."""
    from tritonlocal import shm

    docs = (ROOT / "docs" / "operations.md").read_text()
    assert "stubs x 32 MiB  +  the growth of the stubs that pass large tensors" in docs
    assert flags.SHM_DEFAULT_BYTES == 32 * shm.MIB and flags.SHM_GROWTH_BYTES == 16 * shm.MIB
    # The tagger's logits are large (28.7 MB a sequence), PIXELS (602 KB an image) is not.
    assert shm.LARGE_ROW_BYTES < S.TAGGER_SEQ_LEN * S.TAGGER_VOCAB * 4
    assert shm.LARGE_ROW_BYTES > 3 * S.IMAGE_SIZE * S.IMAGE_SIZE * 4


def test_an_orchestrator_over_the_logits_tagger_grows_by_its_threads_times_a_full_batch(tmp_path):
    from modelgen import variants
    from tritonlocal import shm

    logits = variants.variant(S.TAG_PIPELINE, "tag_logits", tagger_model="tagger")
    for spec in (logits, S.TAGGER, S.TAG_PIPELINE, S.TAGGER_TAGS):
        (tmp_path / spec.name).mkdir()
        (tmp_path / spec.name / "config.pbtxt").write_text(configs.render(spec))
    result = shm.budget([tmp_path])
    # Each of the pool's threads holds a full batch of logits: 8 x 115 MB.
    threads = int(logits.parameters["subrequest_threads"])
    held = threads * S.TAGGER.max_batch_size * S.TAGGER_SEQ_LEN * S.TAGGER_VOCAB * 4  # 920 MB
    step = flags.SHM_GROWTH_BYTES
    assert result.growing == {"tag_logits": -(-held // step) * step}  # tag_pipeline: tagger_tags
    assert result.stubs == 2 * S.TAG_PIPELINE.instance_count
    assert result.total_bytes == result.stubs * flags.SHM_DEFAULT_BYTES + 2 * result.growing["tag_logits"]


@pytest.mark.parametrize("profile", profiles.PROFILES)
def test_the_shm_sizes_satisfy_the_rule_for_what_each_container_serves(profile, tmp_path, repository):
    """`make test-container` serves the profile and the test-only models (scripts/container-test.sh);
    `make docker-run` and the Kubernetes pod the profile alone. An undersized /dev/shm is not
    noticed at start (regions are only ftruncate'd) but kills stubs with SIGBUS under a burst."""
    from bench.repository import build_test_repository
    from tritonlocal import shm

    served = tmp_path / "served"
    profiles.write(profile, repository, served, cache=str(tmp_path / "cache"))
    test_only = build_test_repository(tmp_path / "test_only", served)

    in_test_container = shm.budget([served, test_only])
    assert in_test_container.stubs > 50  # the test-only models run in stubs too
    assert docker_size(makefile_variable("TEST_SHM_SIZE")) >= in_test_container.total_bytes, (
        f"TEST_SHM_SIZE={makefile_variable('TEST_SHM_SIZE')} < "
        f"{in_test_container.total_bytes / 2**30:.2f} GiB needed")

    server = shm.budget([served])
    assert docker_size(makefile_variable("SHM_SIZE")) >= server.total_bytes
    import yaml

    deployment = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "deployment.yaml").read_text())
    (dshm,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    assert float(dshm["emptyDir"]["sizeLimit"].removesuffix("Gi")) * 2**30 >= server.total_bytes
