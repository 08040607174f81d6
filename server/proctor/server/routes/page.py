"""GET / and GET /page/{name}: the live page, which draws ``GET /dashboard`` in the browser.

Static files from ``server/page``, shipped with the package. They hold no data, so they are open without the
API key; the page sends the key (taken from its URL fragment, ``/#key=...``) when it fetches ``/dashboard``.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from proctor.server.exceptions import NotFoundError

router = APIRouter(include_in_schema=False)

PAGE_DIR = Path(__file__).resolve().parent.parent / "page"
# The files /page/{name} serves, with their content types: nothing else in the folder, no path from the client.
PAGE_FILES = {
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
# The paths of this router: open without the API key (see ApiKeyMiddleware).
OPEN_PATHS = frozenset({"/", *(f"/page/{name}" for name in PAGE_FILES)})
# Revalidate on every load, so that a browser never runs a script older than the server behind it.
_HEADERS = {"Cache-Control": "no-cache"}


@router.get("/")
async def read_page() -> FileResponse:
    """The live page: curriculum, stages, rewards, pass rates and grader errors, polled from /dashboard."""
    return FileResponse(PAGE_DIR / "index.html", media_type="text/html; charset=utf-8", headers=_HEADERS)


@router.get("/page/{name}")
async def read_page_file(name: str) -> FileResponse:
    """The page's script or stylesheet; 404 for any other name."""
    media_type = PAGE_FILES.get(name)
    if media_type is None:
        raise NotFoundError(f"no page file {name[:80]!r}; the page has {', '.join(sorted(PAGE_FILES))}")
    return FileResponse(PAGE_DIR / name, media_type=media_type, headers=_HEADERS)
