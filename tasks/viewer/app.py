"""The web viewer: one static page (`static/index.html`) and a read-only JSON API over `RunData`.

Only GET routes exist; nothing here writes to the run. Unknown iterations, samples and groups
answer 404 with the reason; bad query values answer 422 (FastAPI's validation) or 400.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException
from fastapi import Query as Param
from fastapi.responses import FileResponse

from tasks.viewer.data import (
    MAX_PAGE,
    BadQueryError,
    MaskFilter,
    NotFoundError,
    Query,
    RouteFilter,
    RunData,
    SortKey,
    page,
    summary,
)

logger = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"


def create_app(data: RunData) -> FastAPI:
    """The FastAPI app serving the page and the API for one run."""
    app = FastAPI(title=f"sdpo view {data.layout.run_name}", docs_url=None, redoc_url=None)

    def lookup(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
        """fn(*args); an unknown iteration, sample or group answers 404, a bad list query 400."""
        try:
            return fn(*args)
        except NotFoundError as err:
            raise HTTPException(status_code=404, detail=str(err)) from err
        except BadQueryError as err:
            raise HTTPException(status_code=400, detail=str(err)) from err

    @app.get("/", include_in_schema=False)
    def index_page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/api/run")
    def run_info() -> dict[str, Any]:
        cfg = data.run.cfg
        return {
            "run": data.layout.run_name,
            "url": data.layout.run_url,
            "loss": cfg.loss.type,
            "feedback": cfg.teacher.feedback,
            "iterations": data.iterations(),
        }

    @app.get("/api/iterations/{n}/summary")
    def iteration_summary(n: int) -> dict[str, Any]:
        return lookup(lambda: summary(data.index(n)))

    @app.get("/api/iterations/{n}/samples")
    def samples(
        n: int,
        sort: SortKey = "sample_id",
        order: Annotated[str, Param(pattern="^(asc|desc)$")] = "asc",
        reward_min: float | None = None,
        reward_max: float | None = None,
        mask: MaskFilter = "all",
        route: RouteFilter = "all",
        data_source: str | None = None,
        finish_reason: str | None = None,
        q: str | None = None,
        offset: Annotated[int, Param(ge=0)] = 0,
        limit: Annotated[int, Param(ge=1, le=MAX_PAGE)] = 50,
    ) -> dict[str, Any]:
        def answer() -> dict[str, Any]:
            query = Query(
                sort=sort,
                descending=order == "desc",
                reward_min=reward_min,
                reward_max=reward_max,
                mask=mask,
                route=route,
                data_source=data_source or None,
                finish_reason=finish_reason or None,
                search=q or None,
                offset=offset,
                limit=limit,
            )
            return page(data.index(n), query)

        return lookup(answer)

    @app.get("/api/iterations/{n}/samples/{sample_id}")
    def sample(n: int, sample_id: int) -> dict[str, Any]:
        from tasks.viewer.samples import sample_detail

        return lookup(sample_detail, data, n, sample_id)

    @app.get("/api/iterations/{n}/groups/{group_id}")
    def group(n: int, group_id: int) -> dict[str, Any]:
        from tasks.viewer.samples import group_detail

        return lookup(group_detail, data, n, group_id)

    return app


def serve(data: RunData, *, host: str, port: int) -> None:
    """Serve the viewer until interrupted."""
    import uvicorn

    logger.info("serving run %s on http://%s:%d/", data.layout.run_url, host, port)
    uvicorn.run(create_app(data), host=host, port=port, log_level="warning")
