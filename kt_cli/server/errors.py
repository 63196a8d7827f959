"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}."""

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unauthorized() -> APIError:
    return APIError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer KEY'",
                    "invalid_request_error", None, "invalid_api_key")


def unknown_model(name: str, served: str) -> APIError:
    return APIError(404, f"The model '{name}' does not exist; this server serves '{served}'",
                    "invalid_request_error", "model", "model_not_found")


def overloaded(limit: int) -> APIError:
    return APIError(503, f"The server is busy: {limit} requests are already queued or running; retry later",
                    "server_overloaded", None, "queue_full")


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down", "server_unavailable", None, "shutting_down")


def engine_failed(message: str) -> APIError:
    return APIError(500, f"The engine failed on this request: {message}", "server_error", None, "engine_error")
