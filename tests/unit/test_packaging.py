"""pyproject.toml builds without setuptools' deprecation warnings, and the files it names ship."""

import re
import tomllib
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_project_metadata_loads_without_a_setuptools_warning(monkeypatch):
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    monkeypatch.chdir(REPO)  # license-files are globbed from the project's root
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the license table's deprecation is a warning, raised here
        dist = apply_configuration(Distribution(), REPO / "pyproject.toml")
    assert dist.metadata.license_expression == "Apache-2.0"
    assert dist.metadata.license_files == ["LICENSE"]


def test_the_build_asks_for_a_setuptools_that_reads_an_spdx_license():
    build = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]
    spec = next(r for r in build["requires"] if r.startswith("setuptools"))
    floor = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", spec)
    assert floor and int(floor.group(1)) >= 77, f"{spec}: an SPDX project.license needs setuptools>=77"


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_the_images_copy_the_license_files_the_build_reads(name):
    files = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["license-files"]
    copied = " ".join(
        line for line in (REPO / "infra" / "docker" / name).read_text().splitlines() if line.startswith("COPY ")
    ).split()
    for path in files:
        assert (REPO / path).is_file(), f"pyproject.toml lists license file {path}, which does not exist"
        assert path in copied, f"infra/docker/{name} builds the project without {path}"
