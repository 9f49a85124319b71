"""The terminal viewer driven headlessly by Textual's pilot: sorting, the mask filter, one sample
with its per-token credit colours and teacher context, the group view, and an SRPO run's routes and
entropy weights."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from storage.shard_reader import read_stage_columns
from tasks.viewer.data import RunData
from tasks.viewer.render import credit_colour, weight_colour
from tasks.viewer.samples import sample_detail
from tasks.viewer.tui import ViewerApp
from tests.synthetic import write_synthetic_run

ROWS = 16


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> RunData:
    root = tmp_path_factory.mktemp("tui")
    write_synthetic_run(str(root / "runs"), "tiny", local_dir=root, rows=ROWS, group_size=4, seed=0)
    return RunData(str(root / "runs"), "tiny")


@pytest.fixture(scope="module")
def shard(data) -> dict:
    return read_stage_columns(data.layout, 1, "teacher")


def _column(app: ViewerApp, position: int) -> list[str]:
    table = app.query_one("#samples")
    return [table.get_row_at(i)[position] for i in range(table.row_count)]


def _hex(color) -> str:  # noqa: ANN001 - a textual Color
    return f"#{color.r:02x}{color.g:02x}{color.b:02x}"


def test_sorting_and_the_mask_filter(data, shard):
    async def drive() -> None:
        app = ViewerApp(data)
        async with app.run_test(size=(160, 50)) as pilot:
            assert _column(app, 0) == [str(i) for i in range(ROWS)]
            await pilot.press("r")  # reward, highest first
            rewards = [float(r) for r in _column(app, 2)]
            assert rewards == sorted(rewards, reverse=True) and rewards[0] > rewards[-1]
            assert [int(i) for i in _column(app, 0)] == sorted(range(ROWS), key=lambda i: (-shard["reward"][i], i))
            await pilot.press("r")  # again: lowest first
            assert [float(r) for r in _column(app, 2)] == sorted(rewards)
            await pilot.press("l")
            lengths = [int(n) for n in _column(app, 3)]
            assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1]
            await pilot.press("d")
            gaps = {
                int(i): float(np.mean(s - t))
                for i, (s, t) in enumerate(
                    zip(shard["sampled_logprobs"], shard["teacher_sampled_logprobs"], strict=True)
                )
            }
            assert [int(i) for i in _column(app, 0)] == sorted(gaps, key=lambda i: (-gaps[i], i))
            await pilot.press("m")  # trained only
            assert set(_column(app, 5)) == {"trained"}
            assert len(_column(app, 5)) == int(np.sum(shard["sample_mask"]))

    asyncio.run(drive())


def test_a_sample_shows_per_token_credit_colours_and_the_teacher_context(data, shard):
    async def drive() -> None:
        app = ViewerApp(data)
        async with app.run_test(size=(160, 50)) as pilot:
            await pilot.press("r", "down", "enter")  # the second-best sample
            await pilot.pause()
            sample_id = int(_column(app, 0)[1])
            content = app.query_one("#detail").visual
            credit = shard["teacher_sampled_logprobs"][sample_id] - shard["sampled_logprobs"][sample_id]
            backgrounds = [
                _hex(span.style.background)
                for span in content.spans
                if getattr(span.style, "background", None) is not None
            ]
            expected = [credit_colour(round(float(c), 4)) for c in credit]
            assert backgrounds == expected
            assert len(set(backgrounds)) > 3  # the colours vary with the credit
            text = content.plain
            assert shard["response_text"][sample_id] in text
            assert "Teacher context" in text and f"source {shard['teacher_source'][sample_id]}" in text
            assert shard["teacher_prompt_text"][sample_id].strip() in text

            await pilot.press("g")
            await pilot.pause()
            group = app.query_one("#detail").visual.plain
            assert f"group {shard['group_id'][sample_id]}: 4 answers" in group
            assert "[demonstration]" in group

    asyncio.run(drive())


def test_an_srpo_run_shows_routes_their_filter_and_the_entropy_weights(tmp_path):
    write_synthetic_run(
        str(tmp_path / "runs"),
        "srpo",
        local_dir=tmp_path,
        rows=ROWS,
        group_size=4,
        seed=2,
        overrides=("loss.type=srpo",),
    )
    data = RunData(str(tmp_path / "runs"), "srpo")
    shard = read_stage_columns(data.layout, 1, "teacher")
    routes = [r.upper() for r in shard["route"]]

    async def drive() -> None:
        app = ViewerApp(data)
        async with app.run_test(size=(160, 50)) as pilot:
            assert _column(app, 6) == routes
            await pilot.press("o")  # SDPO only
            assert set(_column(app, 6)) == {"SDPO"} and len(_column(app, 6)) == routes.count("SDPO")
            await pilot.press("enter")
            await pilot.pause()
            content = app.query_one("#detail").visual
            assert "Route: SDPO: it failed" in content.plain and "Entropy weights" in content.plain
            sample_id = int(_column(app, 0)[0])
            shown = sample_detail(data, 1, sample_id)["tokens"]
            backgrounds = [
                _hex(span.style.background)
                for span in content.spans
                if getattr(span.style, "background", None) is not None
            ]
            weights = [weight_colour(t["weight"]) for t in shown]
            assert backgrounds[-len(weights) :] == weights  # after the credit colours

    asyncio.run(drive())


def test_the_header_shows_run_iteration_and_sort_above_the_search_box(data):
    from textual.widgets import Header, Input

    async def drive() -> None:
        app = ViewerApp(data)
        async with app.run_test(size=(160, 50)) as pilot:
            await pilot.press("r")
            await pilot.pause()
            header, search = app.query_one(Header), app.query_one("#search", Input)
            assert header.region.height >= 1 and not header.region.overlaps(search.region)
            # what is drawn on the header's row is the header, with the run, iteration and sort
            top, _ = app.screen.get_widget_at(header.region.x + header.region.width // 2, header.region.y)
            assert top is header or header in top.ancestors
            title = app.query_one("HeaderTitle").render().plain
            assert "tiny · iteration 1" in title and "sort reward desc" in title

    asyncio.run(drive())


def test_the_sample_list_has_the_focus_while_the_first_page_loads(data):
    """A key pressed while the first page loads (a large run's index takes a while to read) goes to
    the sample list: the first enter opens a sample, it does not submit an empty search."""
    focused_while_loading = []

    class Probe(RunData):
        def index(self, iteration: int):
            focused_while_loading.append(app.focused)
            return super().index(iteration)

    app = ViewerApp(Probe(data.layout.root_url, data.layout.run_name))

    async def drive() -> None:
        async with app.run_test(size=(160, 50)) as pilot:
            assert focused_while_loading == [app.query_one("#samples")]
            await pilot.press("enter")
            await pilot.pause()
            assert app.selected == int(_column(app, 0)[0])
            assert app.query_one("#detail").visual.plain.startswith(f"sample {app.selected} ")

    asyncio.run(drive())
