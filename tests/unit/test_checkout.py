"""The pull step of the deployments (flows/checkout.py): the checkout SDPO_REPO_DIR names on the
worker, or an error that names the variable, its value and what to set."""

from __future__ import annotations

import pytest

from flows.checkout import checkout_dir


def test_the_checkout_is_the_folder_the_variable_names(tmp_path):
    (tmp_path / "configs").mkdir()
    assert checkout_dir({"SDPO_REPO_DIR": str(tmp_path)}) == tmp_path


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (None, "SDPO_REPO_DIR is not set where this flow run started"),
        ("  ", "SDPO_REPO_DIR is not set where this flow run started"),
        ("sdpo-pipeline", "SDPO_REPO_DIR='sdpo-pipeline' is a relative path"),
        ("{tmp}/elsewhere", "SDPO_REPO_DIR='{tmp}/elsewhere' is not a pipeline checkout ({tmp}/elsewhere/configs is"),
        ("{tmp}", "SDPO_REPO_DIR='{tmp}' is not a pipeline checkout ({tmp}/configs is not a folder)"),
    ],
)
def test_a_missing_or_wrong_checkout_names_the_variable_and_what_to_set(tmp_path, value, says):
    environ = {} if value is None else {"SDPO_REPO_DIR": value.format(tmp=tmp_path)}
    with pytest.raises(ValueError) as info:
        checkout_dir(environ)
    message = str(info.value)
    assert says.format(tmp=tmp_path) in message
    assert "set SDPO_REPO_DIR in the worker's environment" in message and "the folder holding configs/" in message
