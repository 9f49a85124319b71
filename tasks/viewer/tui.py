"""The terminal viewer (`sdpo view --tui`): the sample list with the web page's sorting and filters,
and one sample with its per-token credit colouring, teacher context and group.

Keys: r / l / d / i sort by reward, length, divergence, sample id (again: reverse); m cycles the
mask filter, o the route filter (SRPO runs); / focuses the search box; n / p next and previous page; [ / ] previous and next
iteration; enter opens the highlighted sample; g shows its group; q quits. The header names the run,
the iteration, the sort and the filters; the sample list has the focus from the start.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import DataTable, Footer, Header, Input, Static

from tasks.viewer.data import MaskFilter, Query, RouteFilter, RunData, SortKey, page, summary
from tasks.viewer.render import RegionKind

PAGE = 100
_REGION_STYLES: dict[RegionKind, str] = {"think": "italic magenta", "tool_call": "blue", "code": "bold"}
_MASKS: tuple[MaskFilter, ...] = ("all", "trained", "masked")
_ROUTES: tuple[RouteFilter, ...] = ("all", "sdpo", "grpo")


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def segments_text(parts: list[dict[str, Any]]) -> Text:
    """Rendered regions (`render.segments`) as rich Text: think / tool-call / code styled."""
    text = Text()
    for part in parts:
        text.append(part["text"], style=_REGION_STYLES.get(part["kind"], ""))
    return text


def credit_text(tokens: list[dict[str, Any]], *, key: str = "colour") -> Text:
    """The response, each token on the background colour of its credit (`key="weight_colour"`: of
    its entropy weight)."""
    text = Text()
    for token in tokens:
        style = f"black on {token[key]}" if token[key] else ""
        if token["region"]:
            style = f"{style} {_REGION_STYLES[token['region']]}".strip()
        text.append(token["text"], style=style)
    return text


class ViewerApp(App):
    """Sample list on the left, the selected sample (or group) on the right."""

    TITLE = "sdpo view"
    # the search box sits below the header (docked at the top it covered the run, iteration and sort)
    CSS = """
    #samples { width: 45%; }
    #side { width: 55%; padding: 0 1; }
    """
    BINDINGS = [
        Binding("r", "sort('reward')", "reward"),
        Binding("l", "sort('length')", "length"),
        Binding("d", "sort('divergence')", "divergence"),
        Binding("i", "sort('sample_id')", "id"),
        Binding("m", "cycle_mask", "mask filter"),
        Binding("o", "cycle_route", "route filter"),
        Binding("slash", "focus_search", "search"),
        Binding("n", "page(1)", "next page"),
        Binding("p", "page(-1)", "previous page"),
        Binding("right_square_bracket", "iteration(1)", "next iteration"),
        Binding("left_square_bracket", "iteration(-1)", "previous iteration"),
        Binding("g", "group", "group"),
        Binding("q", "quit", "quit"),
    ]

    def __init__(self, data: RunData) -> None:
        super().__init__()
        self.data = data
        self.iterations = [it["iteration"] for it in data.iterations()]
        self.iteration: int | None = self.iterations[-1] if self.iterations else None
        self.sort: SortKey = "sample_id"
        self.descending = False
        self.mask: MaskFilter = "all"
        self.route: RouteFilter = "all"
        self.search = ""
        self.offset = 0
        self.total = 0
        self.selected: int | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield Input(placeholder="search prompt, response, label, feedback (enter)", id="search")
        with Horizontal():
            yield DataTable(id="samples", cursor_type="row", zebra_stripes=True)
            with VerticalScroll(id="side"):
                yield Static(id="detail")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#samples", DataTable)
        table.add_columns("id", "group", "reward", "length", "divergence", "mask", "route", "response")
        # focus now, not after the first page loads: keys pressed while it loads (reading a large
        # run's index takes a while) would go to the search box, the first widget to take focus,
        # and the first enter would search instead of opening a sample
        self.screen.set_focus(table)
        self.reload()

    # -- list ------------------------------------------------------------------------------------
    def reload(self) -> None:
        table = self.query_one("#samples", DataTable)
        table.clear()
        if self.iteration is None:
            self.sub_title = f"{self.data.layout.run_name}: no committed rollout yet"
            return
        index = self.data.index(self.iteration)
        result = page(
            index,
            Query(
                sort=self.sort,
                descending=self.descending,
                mask=self.mask,
                route=self.route,
                search=self.search or None,
                offset=self.offset,
                limit=PAGE,
            ),
        )
        self.total = result["total"]
        for row in result["rows"]:
            mask = "–" if row["mask"] is None else "trained" if row["mask"] else "masked"
            table.add_row(
                str(row["sample_id"]),
                str(row["group_id"]),
                _fmt(row["reward"], 2),
                str(row["length"]),
                _fmt(row["divergence"]),
                mask,
                (row["route"] or "–").upper(),
                row["preview"][:60].replace("\n", " "),
                key=str(row["sample_id"]),
            )
        s = summary(index)
        order = "desc" if self.descending else "asc"
        shown = f"{self.offset + 1 if self.total else 0}-{min(self.offset + PAGE, self.total)} of {self.total}"
        # the header's line, most important first (a narrow terminal cuts its end)
        self.sub_title = (
            f"{self.data.layout.run_name} · iteration {self.iteration} ({s['stage']}) · sort {self.sort} {order} · "
            f"{shown} · mask {self.mask} · route {self.route} · reward {_fmt(s['reward_mean'])}"
        )

    def action_sort(self, key: SortKey) -> None:
        self.descending = (not self.descending) if key == self.sort else key != "sample_id"
        self.sort, self.offset = key, 0
        self.reload()

    def action_cycle_mask(self) -> None:
        self.mask = _MASKS[(_MASKS.index(self.mask) + 1) % len(_MASKS)]
        self.offset = 0
        self.reload()

    def action_cycle_route(self) -> None:
        self.route = _ROUTES[(_ROUTES.index(self.route) + 1) % len(_ROUTES)]
        self.offset = 0
        self.reload()

    def action_focus_search(self) -> None:
        self.query_one("#search", Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.search, self.offset = event.value, 0
        self.reload()
        self.query_one("#samples", DataTable).focus()

    def action_page(self, step: int) -> None:
        offset = self.offset + step * PAGE
        if 0 <= offset < max(self.total, 1):
            self.offset = offset
            self.reload()

    def action_iteration(self, step: int) -> None:
        if self.iteration is None:
            return
        position = self.iterations.index(self.iteration) + step
        if 0 <= position < len(self.iterations):
            self.iteration, self.offset = self.iterations[position], 0
            self.reload()

    # -- one sample, one group -------------------------------------------------------------------
    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.show_sample(int(event.row_key.value))

    def show_sample(self, sample_id: int) -> None:
        from tasks.viewer.samples import sample_detail

        assert self.iteration is not None
        self.selected = sample_id
        s = sample_detail(self.data, self.iteration, sample_id)
        mask = "–" if s["mask"] is None else "trained" if s["mask"] else "masked"
        body = Text()
        title = f"sample {s['sample_id']} · group {s['group_id']} · reward {_fmt(s['reward'])} · {mask}\n"
        body.append(title, style="bold")
        body.append(f"label {s['label']} · finish {s['finish_reason']} · feedback {s['feedback'] or '–'}\n\n")
        body.append("Prompt\n", style="bold underline")
        body.append_text(segments_text(s["prompt"]))
        body.append(
            "\n\nResponse: per-token credit (teacher − student log-prob; green +, red −)\n", style="bold underline"
        )
        body.append_text(credit_text(s["tokens"]))
        if s["route_reason"] is not None:
            body.append(f"\n\nRoute: {s['route_reason']}\n", style="bold")
        if any(t["weight"] is not None for t in s["tokens"]):
            body.append(
                "Entropy weights (blue: the teacher is confident, the token counts more)\n", style="bold underline"
            )
            body.append_text(credit_text(s["tokens"], key="weight_colour"))
        body.append("\n\nTeacher context\n", style="bold underline")
        demo = "none" if s["demonstration"] is None else f"sample {s['demonstration']}"
        body.append(f"source {s['teacher_source'] or '–'} · demonstration {demo}\n{s['mask_reason']}\n")
        if s["teacher_prompt"] is not None:
            body.append_text(segments_text(s["teacher_prompt"]))
        self.query_one("#detail", Static).update(body)

    def action_group(self) -> None:
        from tasks.viewer.samples import group_detail

        if self.selected is None or self.iteration is None:
            return
        index = self.data.index(self.iteration)
        g = group_detail(self.data, self.iteration, int(index.group_id[index.index_of(self.selected)]))
        body = Text(f"group {g['group_id']}: {len(g['members'])} answers\n\n", style="bold")
        for m in g["members"]:
            mark = " [demonstration]" if m["served_as_demonstration"] else ""
            body.append(
                f"sample {m['sample_id']} · reward {_fmt(m['reward'], 2)}{mark}\n",
                style="bold green" if mark else "bold",
            )
            body.append_text(segments_text(m["response"]))
            body.append("\n\n")
        self.query_one("#detail", Static).update(body)
