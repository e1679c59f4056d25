"""The run viewer's HTTP server (aiohttp), on loopback only.

Routes::

    GET /                 the page (static/index.html)
    GET /static/NAME      the page's script and style sheet (only the files shipped in static/)
    GET /api/run          the run's header (RunFiles.run)
    GET /api/series       the learning curves, throughput, staleness and tool latency (RunFiles.series)
    GET /api/episodes     episode summaries: ?kind=&reward=positive|zero&step_min=&step_max=&offset=&limit=
    GET /api/episode      one episode turn by turn: ?step=N&index=I (404 when there is none)

Every answer is JSON (errors too: ``{"error": "..."}`` with 400 for a bad parameter, 404 for nothing there). The
server only reads files of the run folder (``monitoring.viewer.runs``); the page refreshes itself.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from aiohttp import web

from monitoring.viewer.runs import QueryError, RunFiles

HOST = "127.0.0.1"
STATIC = {  # name -> content type: exactly the files the page needs, nothing else is served
    "index.html": "text/html",
    "viewer.js": "text/javascript",
    "viewer.css": "text/css",
}
_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    # the page loads nothing from elsewhere and runs only its own script
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
}


def static_text(name: str) -> str:
    """A file of the page, read from the installed package."""
    return resources.files("monitoring.viewer").joinpath("static", name).read_text(encoding="utf-8")


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(data, allow_nan=False), status=status, content_type="application/json",
                        headers=_HEADERS)


def make_app(run_dir: str | Path) -> web.Application:
    """The viewer's application for ``run_dir``."""
    files = RunFiles(Path(run_dir))

    def api(fn: Callable[[web.Request], Any]) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.Response:
            try:
                data = fn(request)
            except QueryError as e:
                return _json({"error": str(e)}, status=400)
            if data is None:
                return _json({"error": f"nothing at {request.path_qs}"}, status=404)
            return _json(data)

        return handler

    def q(request: web.Request, *names: str) -> dict[str, str]:
        return {n: request.query[n] for n in names if n in request.query}

    async def page(request: web.Request) -> web.Response:
        return web.Response(text=static_text("index.html"), content_type="text/html", headers=_HEADERS)

    async def static(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC:
            return _json({"error": f"no file {name!r}"}, status=404)
        return web.Response(text=static_text(name), content_type=STATIC[name], headers=_HEADERS)

    async def no_icon(request: web.Request) -> web.Response:
        return web.Response(status=204, headers=_HEADERS)

    async def not_found(request: web.Request) -> web.Response:
        return _json({"error": f"nothing at {request.path}"}, status=404)

    app = web.Application()
    app.router.add_get("/", page)
    app.router.add_get("/favicon.ico", no_icon)
    app.router.add_get("/static/{name}", static)
    app.router.add_get("/api/run", api(lambda r: files.run()))
    app.router.add_get("/api/series", api(lambda r: files.series()))
    app.router.add_get("/api/episodes", api(lambda r: files.episodes(
        **q(r, "kind", "reward", "step_min", "step_max", "offset", "limit"))))
    app.router.add_get("/api/episode", api(lambda r: files.episode(r.query.get("step", ""), r.query.get("index", ""))))
    app.router.add_route("*", "/{tail:.*}", not_found)
    app["files"] = files
    return app


async def start(run_dir: str | Path, port: int = 0) -> tuple[web.AppRunner, int]:
    """Serve ``run_dir`` on ``127.0.0.1:port`` (0: a free port); the runner (``await runner.cleanup()`` to stop) and
    the port."""
    runner = web.AppRunner(make_app(run_dir), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, HOST, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, int(runner.addresses[0][1])  # the port the OS picked for port 0
