"""infra/ cannot rot silently: every YAML and JSON file parses, and each recipe agrees with the code.

The Dockerfiles copy files that exist and install the pinned versions; the work-pool templates
are base job templates the Prefect workers accept; the Kubernetes manifests, `launch.sh` and
`node.sh` start the commands the tests and the launchers start.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"


def infra_files(*suffixes: str) -> list[Path]:
    return sorted(p for p in INFRA.rglob("*") if p.is_file() and p.suffix in suffixes)


def pins() -> dict[str, str]:
    """name -> version of every `name==version` in pyproject.toml (dependencies and extras)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    specs = [*project["dependencies"], *(s for extra in project["optional-dependencies"].values() for s in extra)]
    found = {}
    for spec in specs:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?==([^;\s]+)(?:\s*;.*)?", spec)
        if match and ";" not in spec:
            found[match.group(1).lower()] = match.group(2)
    return found


def k8s(name: str) -> list[dict]:
    return list(yaml.safe_load_all((INFRA / "k8s" / name).read_text()))


def one(docs: list[dict], kind: str) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


# --------------------------------------------------------------------------- parsing


def test_infra_has_the_cluster_recipes():
    names = {str(p.relative_to(INFRA)) for p in INFRA.rglob("*") if p.is_file()}
    assert {
        "docker/Dockerfile.cpu",
        "docker/Dockerfile.cuda",
        "prefect/work-pools/process.json",
        "prefect/work-pools/kubernetes.json",
        "k8s/sglang-servers.yaml",
        "k8s/router.yaml",
        "sglang/launch.sh",
        "torchrun/node.sh",
        "torchrun/two-nodes.yaml",
    } <= names


@pytest.mark.parametrize("path", infra_files(".yaml", ".yml"), ids=lambda p: str(p.relative_to(INFRA)))
def test_every_yaml_file_parses(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs and all(isinstance(d, dict) for d in docs)
    if path.parent.name == "k8s":
        for doc in docs:
            assert {"apiVersion", "kind", "metadata"} <= set(doc), doc
            assert doc["metadata"]["name"] and doc["metadata"]["namespace"] == "sdpo"


@pytest.mark.parametrize("path", infra_files(".json"), ids=lambda p: str(p.relative_to(INFRA)))
def test_every_json_file_parses(path):
    assert isinstance(json.loads(path.read_text()), dict)


# --------------------------------------------------------------------------- Dockerfiles


def dockerfile(name: str) -> list[str]:
    """The instructions of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (INFRA / "docker" / name).read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def ignored(path: str) -> bool:
    """Whether .dockerignore keeps `path` (relative to the repository root) out of the build context."""
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines() if p.strip() and p[0] != "#"]
    return any(Path(path).match(p.lstrip("/")) or path.split("/")[0] == p.lstrip("/") for p in patterns)


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfiles_copy_files_that_exist_and_install_the_pins(name):
    lines = dockerfile(name)
    copies = [shlex.split(line)[1:-1] for line in lines if line.startswith("COPY ")]
    assert copies
    for sources in copies:
        for source in sources:
            assert (REPO / source).exists(), f"{name} copies {source}, which does not exist"
            assert not ignored(source), f"{name} copies {source}, which .dockerignore leaves out"
    for package in ("flows", "tasks", "sdpo_core", "storage"):  # what pyproject's packages.find includes
        assert any(package in sources for sources in copies), f"{name} does not copy {package}/"
    versions = pins()
    installs = [line for line in lines if "pip install" in line]
    # as the Makefile does: torch first from its index, then the project with the lock as constraints
    torch_at = next(i for i, line in enumerate(installs) if f"torch=={versions['torch']}" in line)
    project_at = next(i for i, line in enumerate(installs) if re.search(r'-c requirements/lock.txt -e "?\.', line))
    assert torch_at < project_at
    assert "--index-url" in installs[torch_at]
    assert f"pip=={_makefile_pip()}" in " ".join(installs)


def _makefile_pip() -> str:
    return re.search(r"pip install -q -U pip==(\S+)", (REPO / "Makefile").read_text()).group(1)


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_the_pipeline_images_name_their_checkout_for_the_deployments(name):
    """A flow run in a pipeline image (a Kubernetes job, a worker in the image) enters the checkout
    SDPO_REPO_DIR names (flows/checkout.py): the image's own, where it put the project."""
    lines = dockerfile(name)
    pipeline = lines[next(i for i, line in enumerate(lines) if line.endswith("AS sdpo")) :] if "cuda" in name else lines
    workdir = next(line.split()[1] for line in pipeline if line.startswith("WORKDIR "))
    env = dict(word.split("=", 1) for line in pipeline if line.startswith("ENV ") for word in shlex.split(line)[1:])
    assert env["SDPO_REPO_DIR"] == workdir == "/opt/sdpo"


def test_the_sglang_image_installs_the_pinned_server_and_router():
    lines = dockerfile("Dockerfile.cuda")
    stages = [line.split()[-1] for line in lines if line.startswith("FROM ")]
    assert stages == ["sglang", "sdpo"]  # the pipeline is the default (last) target
    versions = pins()
    sglang = " ".join(lines[: next(i for i, line in enumerate(lines) if line.endswith("AS sdpo"))])
    assert f"sglang=={versions['sglang']}" in sglang and f"sglang-router=={versions['sglang-router']}" in sglang
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB=1" in sglang


# --------------------------------------------------------------------------- Prefect deployments


def test_the_deployments_find_their_checkout_on_the_worker_when_the_flow_run_starts(monkeypatch, tmp_path):
    """`prefect deploy` fills every `{{ $VAR }}` of a pull step from the deploying machine's
    environment when the variable is set there, baking that machine's path into the deployment;
    the pull steps read SDPO_REPO_DIR on the worker instead (flows/checkout.py)."""
    import importlib

    from prefect.utilities.templating import PlaceholderType, find_placeholders

    deployments = yaml.safe_load((INFRA / "prefect" / "prefect.yaml").read_text())
    steps = deployments["pull"]
    assert not [p for p in find_placeholders(steps) if p.type is PlaceholderType.ENV_VAR], steps
    assert not any("pull" in d for d in deployments["deployments"])  # every deployment runs the steps above
    (step,) = steps
    ((fqn, inputs),) = step.items()
    module, name = fqn.rsplit(".", 1)
    enter = getattr(importlib.import_module(module), name)
    (tmp_path / "configs").mkdir()
    monkeypatch.setenv("SDPO_REPO_DIR", str(tmp_path))
    monkeypatch.chdir(REPO)
    assert enter(**inputs) == {"directory": str(tmp_path)} and Path.cwd() == tmp_path


def test_every_schedule_the_deployments_create_names_its_run_in_parameters_of_its_own():
    """A schedule without parameters of its own ticks with the deployment's defaults: after a
    toggle that cleared them it would advance another run, unnoticed; `sdpo resume-schedule`
    refuses such a schedule, and none is created that way."""
    deployments = yaml.safe_load((INFRA / "prefect" / "prefect.yaml").read_text())["deployments"]
    schedules = [(d["name"], s) for d in deployments for s in d.get("schedules", [])]
    assert schedules  # the scheduled sdpo-advance deployment
    for name, schedule in schedules:
        deployment = next(d for d in deployments if d["name"] == name)
        assert set(schedule.get("parameters", {})) == set(deployment["parameters"]), (name, schedule)
        assert (REPO / schedule["parameters"]["config_path"]).is_file(), schedule


# --------------------------------------------------------------------------- Prefect work pools


def defaults(template: dict) -> dict:
    return {k: v["default"] for k, v in template["variables"]["properties"].items() if "default" in v}


def check_base_job_template(template: dict) -> dict:
    """What Prefect checks of a base job template; returns the job configuration at the defaults."""
    from jsonschema import Draft202012Validator
    from prefect.utilities.templating import apply_values, find_placeholders

    assert set(template) == {"job_configuration", "variables"}
    Draft202012Validator.check_schema(template["variables"])
    Draft202012Validator(template["variables"]).validate(defaults(template))
    used = {p.name for p in find_placeholders(template["job_configuration"])}
    declared = set(template["variables"]["properties"])
    assert used == declared, f"undeclared: {sorted(used - declared)}, unused: {sorted(declared - used)}"
    return apply_values(template["job_configuration"], defaults(template))


def test_the_process_work_pool_template_is_one_the_process_worker_accepts():
    from prefect.workers.process import ProcessJobConfiguration, ProcessWorker

    template = json.loads((INFRA / "prefect" / "work-pools" / "process.json").read_text())
    config = ProcessJobConfiguration.model_validate(check_base_job_template(template))
    assert str(config.working_dir) == "/opt/sdpo"  # where the images put the project (WORKDIR)
    assert set(template["job_configuration"]) == set(ProcessWorker.get_default_base_job_template()["job_configuration"])


# The Kubernetes worker (prefect-kubernetes, KubernetesWorkerJobConfiguration) reads these fields of
# job_configuration, and requires the job manifest to hold these paths with these values.
K8S_JOB_CONFIGURATION = {
    "command",
    "env",
    "labels",
    "name",
    "namespace",
    "job_manifest",
    "cluster_config",
    "job_watch_timeout_seconds",
    "pod_watch_timeout_seconds",
    "stream_output",
}
K8S_REQUIRED_MANIFEST = {
    "apiVersion": "batch/v1",
    "kind": "Job",
    "spec.template.spec.parallelism": 1,
    "spec.template.spec.completions": 1,
    "spec.template.spec.restartPolicy": "Never",
    "spec.template.spec.containers.0.name": "prefect-job",
}


def at(tree, dotted: str):
    for key in dotted.split("."):
        tree = tree[int(key)] if isinstance(tree, list) else tree[key]
    return tree


def test_the_kubernetes_work_pool_template_has_what_the_kubernetes_worker_expects():
    template = json.loads((INFRA / "prefect" / "work-pools" / "kubernetes.json").read_text())
    assert set(template["job_configuration"]) == K8S_JOB_CONFIGURATION
    resolved = check_base_job_template(template)
    manifest = resolved["job_manifest"]
    for path, value in K8S_REQUIRED_MANIFEST.items():
        assert at(manifest, path) == value, path
    assert isinstance(at(manifest, "metadata.labels"), dict) and manifest["metadata"]["namespace"] == "sdpo"
    pod = manifest["spec"]["template"]["spec"]
    container = pod["containers"][0]
    gpus = defaults(template)["gpus"]
    assert (
        container["resources"]["limits"]["nvidia.com/gpu"]
        == gpus
        == container["resources"]["requests"]["nvidia.com/gpu"]
    )
    # the stage pods and the SGLang servers mount one cache claim at /cache: servers load checkpoints from it
    claim = one(k8s("cache-pvc.yaml"), "PersistentVolumeClaim")["metadata"]["name"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/cache"]]["persistentVolumeClaim"]["claimName"] == claim
    assert "ReadWriteMany" in one(k8s("cache-pvc.yaml"), "PersistentVolumeClaim")["spec"]["accessModes"]


# --------------------------------------------------------------------------- Kubernetes and SGLang


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_router_routes_to_every_server_of_the_statefulset():
    servers = k8s("sglang-servers.yaml")
    statefulset, service = one(servers, "StatefulSet"), one(servers, "Service")
    assert service["spec"]["clusterIP"] == "None" and statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    server = statefulset["spec"]["template"]["spec"]["containers"][0]
    port = int(flag(server["args"], "--port"))
    namespace = statefulset["metadata"]["namespace"]
    pods = [
        f"http://{statefulset['metadata']['name']}-{i}.{service['metadata']['name']}.{namespace}.svc:{port}"
        for i in range(statefulset["spec"]["replicas"])
    ]
    router_docs = k8s("router.yaml")
    router = one(router_docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    args = router["args"]
    assert router["command"] == ["python", "-m", "sglang_router.launch_router"]
    urls = args[args.index("--worker-urls") + 1 : next(i for i, a in enumerate(args) if a == "--host")]
    assert urls == pods
    assert int(one(router_docs, "Service")["spec"]["ports"][0]["targetPort"]) == int(flag(args, "--port"))
    # the settings the rollout client relies on (docs/sglang.md), as launch.sh starts the servers
    assert server["command"] == ["python", "-m", "sglang.launch_server"]
    assert flag(server["args"], "--sampling-backend") == "pytorch"
    assert {"name": "SGLANG_RETURN_ORIGINAL_LOGPROB", "value": "1"} in server["env"]
    assert int(flag(server["args"], "--tp-size")) == server["resources"]["limits"]["nvidia.com/gpu"]
    assert flag(args, "--policy") == "round_robin"


def run_script(script: str, *args: str, python: str) -> str:
    done = subprocess.run(
        ["bash", str(INFRA / script), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(os.environ, PYTHON=python),
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_launch_sh_starts_the_router_the_router_test_starts():
    from tests.sglang_server.router import router_command

    out = run_script(
        "sglang/launch.sh",
        "--model-path",
        "/ckpt",
        "--servers",
        "3",
        "--host",
        "127.0.0.1",
        "--base-port",
        "30000",
        "--router-port",
        "29000",
        "--dry-run",
        python="python",
    )
    commands = [shlex.split(line[2:]) for line in out.splitlines() if line.startswith("+ ")]
    urls = [f"http://127.0.0.1:{30000 + i}" for i in range(3)]
    assert [c[c.index("--port") + 1] for c in commands[:3]] == ["30000", "30001", "30002"]
    assert commands[3][1:] == router_command(urls, host="127.0.0.1", port=29000)[1:]
    assert 'router_url: "http://127.0.0.1:29000"' in out


def test_node_sh_launches_the_command_of_the_torchrun_launcher(tmp_path):
    from tasks.config import LaunchConfig
    from tasks.launch import stage_command

    launch = LaunchConfig.model_validate(yaml.safe_load((INFRA / "torchrun" / "two-nodes.yaml").read_text())["launch"])
    spec = launch.train.model_dump() | {"node_rank": 1}
    fake = tmp_path / "python"  # prints the command it was given, as one line
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(0o755)
    out = run_script(
        "torchrun/node.sh",
        "--root",
        "s3://bucket/runs",
        "--run-name",
        "r",
        "--from",
        "2",
        "--to",
        "3",
        "--nproc-per-node",
        str(spec["nproc_per_node"]),
        "--nnodes",
        str(spec["nnodes"]),
        "--node-rank",
        "1",
        "--rdzv-endpoint",
        spec["rdzv_endpoint"],
        python=str(fake),
    )
    launched = [line for line in out.splitlines() if not line.startswith("+ ")]
    assert launched == [" ".join(stage_command("train", "s3://bucket/runs", "r", n, spec)[1:]) for n in (2, 3)]
