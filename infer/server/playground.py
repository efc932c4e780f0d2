"""The pages a browser opens: the playground at ``/`` (and ``/playground``) and the API docs
at ``/docs``.

Every asset comes from this package (``static/``, plain ES modules, no build step) or from
``swagger-ui-py``'s bundled copy of Swagger UI: nothing is fetched from elsewhere, so both
pages work on a machine without internet. They are open without an API key (a browser
cannot send one when it navigates); the playground keeps the key the user types and sends
it with every API call it makes.
"""

from __future__ import annotations

from pathlib import Path

import swagger_ui
from quart import Blueprint, Response, send_from_directory
from quart_schema import hide

from infer.api.errors import APIError, ErrorCode

STATIC = Path(__file__).parent / "static"
SWAGGER = Path(swagger_ui.__file__).parent / "static"
SWAGGER_ASSETS = frozenset({"swagger-ui-bundle.js", "swagger-ui.css", "LICENSE"})
PREFIXES = ("/playground/", "/docs/")  # open to every client, as are the exact paths below
PATHS = frozenset({"/", "/playground", "/docs", "/openapi.json"})

blueprint = Blueprint("pages", __name__)


def is_open(path: str) -> bool:
    """Whether ``path`` is one of these pages or their assets (served without a key)."""
    return path in PATHS or path.startswith(PREFIXES)


@blueprint.get("/")
@blueprint.get("/playground")
@hide  # a page, not part of the API: left out of /openapi.json
async def playground() -> Response:
    """The playground page."""
    return await _send(STATIC, "index.html")


@blueprint.get("/playground/<name>")
@hide
async def playground_asset(name: str) -> Response:
    """One of the playground's scripts or its stylesheet."""
    if name == "index.html" or not (STATIC / name).is_file():
        raise APIError(ErrorCode.NOT_FOUND)
    return await _send(STATIC, name)


@blueprint.get("/docs")
@hide
async def docs() -> Response:
    """Swagger UI over ``/openapi.json``."""
    return Response(DOCS_PAGE, content_type="text/html; charset=utf-8")


@blueprint.get("/docs/<name>")
@hide
async def docs_asset(name: str) -> Response:
    """Swagger UI's script, stylesheet and licence."""
    if name not in SWAGGER_ASSETS:
        raise APIError(ErrorCode.NOT_FOUND)
    return await _send(SWAGGER, name)


async def _send(folder: Path, name: str) -> Response:
    response = await send_from_directory(folder, name)
    response.cache_control.no_cache = True  # revalidate: a new version shows at once
    return response


DOCS_PAGE = """<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>infer API</title>
  <link rel="icon" href="data:,">
  <link rel="stylesheet" href="/docs/swagger-ui.css">
</head>
<body>
  <div id="swagger-ui"></div>
  <script src="/docs/swagger-ui-bundle.js"></script>
  <script>
    window.ui = SwaggerUIBundle({
      url: "/openapi.json",
      dom_id: "#swagger-ui",
      deepLinking: true,
      validatorUrl: null,
      presets: [SwaggerUIBundle.presets.apis],
      layout: "BaseLayout",
    });
  </script>
</body>
</html>
"""
