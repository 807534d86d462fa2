"""Every failure leaves the server as OpenAI's error shape: ``{"error": {message, type, param, code}}``.

Client mistakes are 4xx (400 for anything invalid, like OpenAI, not FastAPI's 422); only a bug in the
server is a 500. ``ClientGone`` marks a request whose client hung up: nobody reads the answer, so it is
logged as 499 (nginx's "client closed request").
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddtree.errors import DDTreeError
from ddtree.server.protocol import BOUND_ERROR

log = logging.getLogger("ddtree.server")

CLIENT_CLOSED = 499
_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}
_CODES = {
    "extra_forbidden": "unknown_parameter",
    "missing": "missing_required_parameter",
    "json_invalid": "invalid_json",
}


class APIError(Exception):
    """An answer that is not a success: status, OpenAI error fields and any headers (Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ClientGone(Exception):
    """The client disconnected before its answer was complete."""


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unsupported(param: str, message: str | None = None) -> APIError:
    return invalid(message or f"{param} is not supported by this server", param, "unsupported_parameter")


def validation_error(exc: RequestValidationError) -> APIError:
    """One readable message for pydantic's error list (a union field reports one error per member)."""
    errors = exc.errors()
    if not errors:
        return invalid("invalid request body")
    chosen = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
    param = _param(chosen.get("loc", ()))
    kind = chosen.get("type")
    if kind == "json_invalid":
        return invalid("request body is not valid JSON", None, "invalid_json")
    if param is None and kind in ("model_attributes_type", "model_type", "dict_type", "missing"):
        return invalid("request body must be a JSON object (Content-Type: application/json)")
    if kind == "extra_forbidden":
        return invalid(f"unrecognized request argument: {param}", param, _CODES[kind])
    message = str(chosen.get("msg", "invalid value"))
    if kind == BOUND_ERROR:  # a ddtree.request.params rule: its own message, as SamplingParams says it
        return invalid(message, param)
    return invalid(f"{param}: {message}" if param else message, param, _CODES.get(kind))


def _param(loc) -> str | None:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content' (union member tags dropped)."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and _FIELD.match(part) and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await _api_error(request, validation_error(exc))

    @app.exception_handler(DDTreeError)
    async def _ddtree(request: Request, exc: DDTreeError) -> JSONResponse:
        return await _api_error(request, invalid(str(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        codes = {404: "not_found", 405: "method_not_allowed"}
        message = {404: f"no such endpoint: {request.method} {request.url.path}"}.get(
            exc.status_code, str(exc.detail)
        )
        return JSONResponse(
            error_body(message, kind, None, codes.get(exc.status_code)),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body("internal server error", "server_error"), status_code=500)
