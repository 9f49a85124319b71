"""Download the wheels a GPU benchmark call carries (`.whl/`, ignored): what the device image lacks.

The device machine has no registry, so the packages the pipeline and TRL import there that its image
does not hold travel with the call (`run` carries at most 64 MiB). The set is computed, not listed:
the dependency closure of the roots below, as this project's virtualenv resolved it (the versions
of `requirements/lock.txt`), minus the packages the image holds (`IMAGE`, as the device's KINDS.md
lists them), plus TRL's side, which is not installed here. Pure-Python wheels and CPython 3.12
manylinux x86_64 wheels only (the image's python3 is 3.12).

    .venv/bin/python benchmarks/gpu/carry_wheels.py --dest .whl
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOTS = ["megatron-core", "transformers", "pydantic", "prefect", "mlflow-skinny"]
# versions the device runs where they differ from this machine's (megatron-core: the GPU path's pin)
OVERRIDES = {"megatron-core": "0.19.2"}
# TRL's trainer for the side-by-side runs, not installed here; versions inside datasets' bounds
EXTRA = ["trl==1.16.0", "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19"]
# imported nowhere on the benchmark path: the S3 client stack, notification and git helpers
SKIP = {"apprise", "gitpython", "gitdb", "smmap", "google-auth", "pyasn1", "pyasn1-modules", "boto3", "botocore"}
IMAGE = set(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
    certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jaxlib jaxtyping jinja2 joblib
    kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
    markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
    mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-ml-py onnx onnx-ir
    onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
    packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil
    pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
    scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
    tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision
    tqdm transformers-image treescope triton typer typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
    wrapt xarray xxhash yarl zipp""".split()
)
# carried although the image has a version: the image's is too old for this code
NEWER_THAN_IMAGE = {"transformers", "typing-extensions"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str]) -> dict[str, str]:
    """name -> installed version for the roots and everything they require here, following the extras
    a requirement names (e.g. httpx[http2]), as this machine's resolver did."""
    env = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3"}
    seen: dict[str, str] = {}
    walked: set[tuple[str, str]] = set()
    todo: list[tuple[str, str]] = [(r, "") for r in roots]
    while todo:
        raw, extra = todo.pop()
        name = canonical(raw)
        if (name, extra) in walked or name in SKIP:
            continue
        walked.add((name, extra))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"{name} is required but not installed in {sys.prefix}; run `make setup` first") from None
        seen[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({**env, "extra": extra}):
                todo += [(req.name, "")] + [(req.name, e) for e in req.extras]
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", default=".whl")
    args = parser.parse_args()
    wanted = {n: OVERRIDES.get(n, v) for n, v in closure(ROOTS).items() if n not in IMAGE or n in NEWER_THAN_IMAGE}
    specs = sorted(f"{n}=={v}" for n, v in wanted.items()) + EXTRA
    Path(args.dest).mkdir(parents=True, exist_ok=True)
    print(f"{len(specs)} wheels into {args.dest}: {' '.join(specs)}")
    platforms = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", "3.12", "--implementation", "cp", "-d", args.dest]
    command += [arg for p in platforms for arg in ("--platform", p)]
    subprocess.run([*command, *specs], check=True)
    total = sum(f.stat().st_size for f in Path(args.dest).glob("*.whl"))
    print(f"{args.dest}: {total / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
