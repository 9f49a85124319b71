"""The viewer's JSON API on a tiny synthetic run (no model): list, sort, filters, paging, one sample
with its per-token credit and teacher context, one group with its demonstration, read-only."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from sdpo_core.teacher_context import strip_thinking
from storage.shard_reader import read_stage_columns
from tasks.viewer.app import create_app
from tasks.viewer.data import RunData
from tasks.viewer.render import credit_colour, weight_colour
from tests.synthetic import write_synthetic_run

ROWS, G = 24, 4


@pytest.fixture(scope="module")
def run_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("viewer")
    write_synthetic_run(str(root / "runs"), "tiny", local_dir=root, rows=ROWS, group_size=G, seed=0)
    write_synthetic_run(
        str(root / "runs"), "tiny", local_dir=root, rows=8, group_size=G, seed=1, iteration=2, scored=False
    )
    return root


@pytest.fixture(scope="module")
def client(run_root) -> TestClient:
    return TestClient(create_app(RunData(str(run_root / "runs"), "tiny")))


@pytest.fixture(scope="module")
def shard(run_root) -> dict:
    return read_stage_columns(RunData(str(run_root / "runs"), "tiny").layout, 1, "teacher")


def get(client: TestClient, path: str, **params) -> dict:
    response = client.get(path, params=params)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_run_lists_scored_and_unscored_iterations(client):
    run = get(client, "/api/run")
    assert run["run"] == "tiny"
    assert [(i["iteration"], i["stage"], i["samples"]) for i in run["iterations"]] == [
        (1, "teacher", ROWS),
        (2, "rollout", 8),
    ]


def test_sort_by_reward_length_and_divergence(client, shard):
    divergence = [
        float(np.mean(s - t)) for s, t in zip(shard["sampled_logprobs"], shard["teacher_sampled_logprobs"], strict=True)
    ]
    for sort, values in [
        ("reward", shard["reward"]),
        ("length", [len(r) for r in shard["response_ids"]]),
        ("divergence", divergence),
    ]:
        rows = get(client, "/api/iterations/1/samples", sort=sort, order="desc", limit=100)["rows"]
        expected = sorted(range(ROWS), key=lambda i: (-values[i], shard["sample_id"][i]))
        assert [r["sample_id"] for r in rows] == [int(shard["sample_id"][i]) for i in expected], sort
    assert rows[0]["divergence"] == pytest.approx(max(divergence), abs=1e-5)


def test_filters_and_search_keep_exactly_the_matching_samples(client, shard):
    def ids(**params):
        return {r["sample_id"] for r in get(client, "/api/iterations/1/samples", limit=100, **params)["rows"]}

    every = range(ROWS)
    assert ids(mask="masked") == {i for i in every if not shard["sample_mask"][i]} != set()
    assert ids(mask="trained") == {i for i in every if shard["sample_mask"][i]}
    assert ids(reward_min=0.5) == {i for i in every if shard["reward"][i] >= 0.5}
    assert ids(reward_max=0.5) == {i for i in every if shard["reward"][i] <= 0.5}
    assert (
        ids(data_source="synthetic_code") == {i for i in every if shard["data_source"][i] == "synthetic_code"} != set()
    )
    assert ids(finish_reason="length") == {i for i in every if shard["finish_reason"][i] == "length"} != set()
    assert ids(q="TOOL_CALL") == {i for i in every if "tool_call" in shard["response_text"][i]} != set()
    assert ids(q="wrong sign") == {i for i in every if shard["feedback"][i]}  # search covers feedback
    assert ids(mask="trained", data_source="synthetic_math") == ids(mask="trained") & ids(data_source="synthetic_math")


def test_pages_partition_the_sorted_list(client):
    whole = get(client, "/api/iterations/1/samples", sort="reward", order="desc", limit=100)
    pages = [
        get(client, "/api/iterations/1/samples", sort="reward", order="desc", offset=o, limit=5)
        for o in range(0, ROWS, 5)
    ]
    assert all(p["total"] == ROWS for p in pages)
    assert [r["sample_id"] for p in pages for r in p["rows"]] == [r["sample_id"] for r in whole["rows"]]
    assert get(client, "/api/iterations/1/samples", offset=ROWS)["rows"] == []


def test_bad_queries_are_refused(client):
    assert client.get("/api/iterations/1/samples", params={"sort": "nonsense"}).status_code == 422
    assert client.get("/api/iterations/1/samples", params={"limit": 10_000}).status_code == 422
    response = client.get("/api/iterations/2/samples", params={"mask": "masked"})
    assert response.status_code == 400 and "not scored" in response.json()["detail"]


def test_one_sample_carries_per_token_credit_and_the_top_k(client, shard):
    i = 5
    s = get(client, f"/api/iterations/1/samples/{i}")
    credit = shard["teacher_sampled_logprobs"][i] - shard["sampled_logprobs"][i]
    tokens = s["tokens"]
    assert len(tokens) == len(shard["response_ids"][i])
    assert "".join(t["text"] for t in tokens) == shard["response_text"][i]
    assert [t["credit"] for t in tokens] == pytest.approx(credit.tolist(), abs=1e-4)
    assert [t["colour"] for t in tokens] == [credit_colour(t["credit"]) for t in tokens]
    first = tokens[0]["alternatives"]
    assert [a["student"] for a in first] == pytest.approx(np.exp(shard["topk_logprobs"][i][0]).tolist(), abs=1e-4)
    assert [a["teacher"] for a in first] == pytest.approx(
        np.exp(shard["teacher_topk_logprobs"][i][0]).tolist(), abs=1e-4
    )
    assert tokens[0]["text"] in [a["text"] for a in first]  # the sampled token is one of the candidates


def test_one_sample_shows_the_chat_template_regions_and_the_teacher_context(client, shard):
    s = get(client, "/api/iterations/1/samples/0")  # "<think>...</think>The answer is 12."
    assert "".join(p["text"] for p in s["prompt"]).startswith("<|im_start|>user\n")
    assert [p["kind"] for p in s["response"]] == ["think", None]
    assert {t["region"] for t in s["tokens"][:5]} == {"think"}
    assert "".join(p["text"] for p in s["teacher_prompt"]) == shard["teacher_prompt_text"][0]
    assert s["teacher_source"] == shard["teacher_source"][0]
    assert s["label"] == shard["label"][0] and s["feedback"] == shard["feedback"][0]


def test_the_demonstration_is_the_answer_the_teacher_prompt_carries(client, shard):
    checked = 0
    for i in range(ROWS):
        s = get(client, f"/api/iterations/1/samples/{i}")
        if s["demonstration"] is None:
            assert "Correct solution" not in shard["teacher_prompt_text"][i]
            continue
        checked += 1
        # each group holds four different answers, so only the right one is found
        assert strip_thinking(shard["response_text"][s["demonstration"]]) in shard["teacher_prompt_text"][i]
        assert shard["group_id"][s["demonstration"]] == shard["group_id"][i]
    assert checked > ROWS // 2


def test_a_masked_sample_says_why(client, shard):
    masked = [i for i in range(ROWS) if not shard["sample_mask"][i]]
    s = get(client, f"/api/iterations/1/samples/{masked[0]}")
    assert s["mask"] is False and s["demonstration"] is None
    assert s["mask_reason"].startswith("masked: no demonstration")
    trained = get(client, f"/api/iterations/1/samples/{int(np.flatnonzero(shard['sample_mask'])[0])}")
    assert trained["mask_reason"].startswith("trained on; the teacher saw: ")


def test_an_unscored_iteration_shows_samples_without_credit(client):
    s = get(client, "/api/iterations/2/samples/0")
    assert s["mask"] is None and s["teacher_prompt"] is None and s["demonstration"] is None
    assert all(t["credit"] is None and t["colour"] is None and t["teacher"] is None for t in s["tokens"])
    assert "not scored by the teacher yet" in s["mask_reason"]


def test_the_group_view_shows_every_answer_and_which_served_as_demonstration(client, shard):
    g = get(client, "/api/iterations/1/groups/1")
    members = [m["sample_id"] for m in g["members"]]
    assert members == [i for i in range(ROWS) if shard["group_id"][i] == 1]
    demos = {m["demonstration"] for m in g["members"]} - {None}
    assert {m["sample_id"] for m in g["members"] if m["served_as_demonstration"]} == demos
    assert [m["reward"] for m in g["members"]] == [float(shard["reward"][i]) for i in members]


def test_unknown_ids_answer_404(client):
    assert client.get("/api/iterations/1/samples/999").status_code == 404
    assert client.get("/api/iterations/1/groups/999").status_code == 404
    assert client.get("/api/iterations/7/summary").status_code == 404


def test_the_api_is_read_only(client, run_root):
    def digest() -> str:
        files = sorted(p for p in (run_root / "runs").rglob("*") if p.is_file())
        return hashlib.sha256(b"".join(str(p).encode() + p.read_bytes() for p in files)).hexdigest()

    before = digest()
    for method in ("post", "put", "delete", "patch"):
        assert getattr(client, method)("/api/iterations/1/samples/0").status_code == 405
    get(client, "/api/iterations/1/samples/3")
    get(client, "/api/iterations/1/groups/0")
    assert digest() == before


def test_the_page_is_served(client):
    response = client.get("/")
    assert response.status_code == 200 and 'id="samples"' in response.text


def test_the_viewer_reads_a_run_on_s3(tmp_path, s3_root, s3_options):
    from storage.urls import register_options
    from tasks import tokenizers

    tokenizers.forget()  # a viewer process of its own keeps no tokenizer yet
    register_options(s3_root, s3_options)
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "model.safetensors").write_bytes(b"\0" * 100_000)  # weights beside the tokenizer
    write_synthetic_run(s3_root, "tiny", local_dir=tmp_path, rows=8, group_size=G, seed=2)
    client = TestClient(create_app(RunData(s3_root, "tiny")))
    rows = get(client, "/api/iterations/1/samples", sort="reward", order="desc")["rows"]
    assert len(rows) == 8 and rows[0]["reward"] >= rows[-1]["reward"]
    assert get(client, "/api/iterations/1/samples/7")["tokens"][0]["credit"] is not None
    fetched = [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert "tokenizer.json" in fetched and "model.safetensors" not in fetched  # the tokenizer without the weights


def test_sdpo_view_binds_to_loopback_unless_told_otherwise(run_root, monkeypatch):
    from typer.testing import CliRunner

    import tasks.viewer.app
    from flows.cli import app

    served = []
    monkeypatch.setattr(tasks.viewer.app, "serve", lambda data, **kw: served.append((data.layout.run_name, kw)))
    root = str(run_root / "runs")
    result = CliRunner().invoke(app, ["view", "tiny", "--root", root])
    assert result.exit_code == 0, result.output
    assert served[-1] == ("tiny", {"host": "127.0.0.1", "port": 8765})
    assert "http://127.0.0.1:8765/" in result.output
    result = CliRunner().invoke(app, ["view", "tiny", "--root", root, "--port", "9000", "--host", "0.0.0.0"])
    assert result.exit_code == 0 and served[-1][1] == {"host": "0.0.0.0", "port": 9000}


def test_sdpo_view_tui_starts_the_terminal_viewer(run_root, monkeypatch):
    from typer.testing import CliRunner

    from flows.cli import app
    from tasks.viewer.tui import ViewerApp

    started = []
    monkeypatch.setattr(ViewerApp, "run", lambda self: started.append(self.iterations))
    result = CliRunner().invoke(app, ["view", "tiny", "--root", str(run_root / "runs"), "--tui"])
    assert result.exit_code == 0, result.output
    assert started == [[1, 2]]


def test_sdpo_view_on_a_missing_run_names_it(tmp_path):
    from typer.testing import CliRunner

    from flows.cli import app

    result = CliRunner().invoke(app, ["view", "nope", "--root", str(tmp_path)])
    assert result.exit_code == 2
    assert "run 'nope' does not exist" in result.output


def test_view_command_is_what_the_cli_accepts(run_root, monkeypatch):
    import shlex

    from typer.testing import CliRunner

    import tasks.viewer.app
    from flows.cli import app
    from tasks.viewer import view_command

    served = []
    monkeypatch.setattr(tasks.viewer.app, "serve", lambda data, **kw: served.append(data.layout.run_url))
    command = shlex.split(view_command("tiny", str(run_root / "runs")))
    assert command[:2] == ["sdpo", "view"]
    result = CliRunner().invoke(app, command[1:])
    assert result.exit_code == 0, result.output
    assert served == [RunData(str(run_root / "runs"), "tiny").layout.run_url]


def test_the_hover_keeps_the_teachers_favourite_when_k_is_large(tmp_path):
    from tasks.data.bootstrap_model import build_tokenizer
    from tasks.viewer.samples import HOVER_TOP, response_tokens

    tokenizer = build_tokenizer(tmp_path / "tok")
    k = HOVER_TOP + 10
    student = np.log(np.linspace(1.0, 0.01, k) / np.linspace(1.0, 0.01, k).sum())[None, :]  # descending
    teacher = np.full((1, k), -20.0)
    teacher[0, k - 1] = -0.01  # the teacher's favourite is the student's last candidate
    row = {
        "response_ids": np.array([5]),
        "topk_ids": np.arange(k)[None, :],
        "topk_logprobs": student,
        "sampled_logprobs": student[:, 0],
        "teacher_topk_logprobs": teacher,
        "teacher_sampled_logprobs": teacher[:, 0],
        "teacher_entropy": np.array([0.1], dtype=np.float32),
    }
    alternatives = response_tokens(tokenizer, row, weights=None)[0]["alternatives"]
    assert len(alternatives) == HOVER_TOP
    assert alternatives[-1]["teacher"] == pytest.approx(np.exp(-0.01), abs=1e-4)
    assert [a["student"] for a in alternatives[:-1]] == pytest.approx(
        np.exp(student[0, : HOVER_TOP - 1]).tolist(), abs=1e-4
    )


# -- an SRPO run: each sample's route and the entropy weight of each SDPO token ------------------


@pytest.fixture(scope="module")
def srpo_run(tmp_path_factory) -> tuple[TestClient, dict]:
    root = tmp_path_factory.mktemp("viewer-srpo")
    write_synthetic_run(
        str(root / "runs"), "srpo", local_dir=root, rows=ROWS, group_size=G, seed=2, overrides=("loss.type=srpo",)
    )
    data = RunData(str(root / "runs"), "srpo")
    return TestClient(create_app(data)), read_stage_columns(data.layout, 1, "teacher")


def test_the_list_shows_and_filters_each_samples_route(srpo_run, client):
    srpo, shard = srpo_run
    rows = get(srpo, "/api/iterations/1/samples", limit=100)["rows"]
    routes = {int(i): r for i, r in zip(shard["sample_id"], shard["route"], strict=True)}
    assert {r["sample_id"]: r["route"] for r in rows} == routes
    assert {"sdpo", "grpo"} <= set(routes.values())
    for route in ("sdpo", "grpo"):
        kept = get(srpo, "/api/iterations/1/samples", route=route, limit=100)["rows"]
        assert {r["sample_id"] for r in kept} == {i for i, r in routes.items() if r == route}
    share = list(routes.values()).count("sdpo") / ROWS
    assert get(srpo, "/api/iterations/1/summary")["routed_sdpo_fraction"] == pytest.approx(share)
    # a run whose loss does not route: no route, no share
    assert {r["route"] for r in get(client, "/api/iterations/1/samples", limit=100)["rows"]} == {None}
    assert get(client, "/api/iterations/1/summary")["routed_sdpo_fraction"] is None
    assert srpo.get("/api/iterations/1/samples", params={"route": "blend"}).status_code == 422


def test_an_sdpo_routed_sample_shows_each_tokens_entropy_weight(srpo_run):
    srpo, shard = srpo_run
    lengths = [len(r) for r in shard["response_ids"]]
    routed = np.repeat(np.asarray(shard["route"]) == "sdpo", lengths)
    norm = float(np.exp(-np.concatenate(shard["teacher_entropy"]).astype(np.float64))[routed].mean())  # beta = 1
    i = list(shard["route"]).index("sdpo")
    s = get(srpo, f"/api/iterations/1/samples/{int(shard['sample_id'][i])}")
    assert s["route"] == "sdpo" and s["route_reason"].startswith("SDPO: it failed")
    entropy = shard["teacher_entropy"][i].astype(np.float64)
    assert [t["entropy"] for t in s["tokens"]] == pytest.approx(entropy.tolist(), abs=1e-4)
    weights = np.exp(-entropy) / norm
    assert [t["weight"] for t in s["tokens"]] == pytest.approx(weights.tolist(), abs=1e-4)
    assert [t["weight_colour"] for t in s["tokens"]] == [weight_colour(w) for w in [t["weight"] for t in s["tokens"]]]
    assert s["pass_rate"] == pytest.approx(float(shard["pass_rate"][i]))

    j = list(shard["route"]).index("grpo")
    g = get(srpo, f"/api/iterations/1/samples/{int(shard['sample_id'][j])}")
    assert g["route"] == "grpo" and g["route_reason"].startswith("GRPO: ")
    assert {t["weight"] for t in g["tokens"]} == {None}  # the GRPO term has no entropy weights
    assert all(t["entropy"] is not None for t in g["tokens"])
