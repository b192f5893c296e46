"""The error a request is answered with, in OpenAI's shape: checks that refuse a request
(`openai_api`, `tools`, `guards`) raise `ApiError`, and `error_body` is what is sent.

Example:
  >>> error_body(ApiError("'n' must be in [1, 16]; got 0", "n"))["error"]["param"]
  'n'
"""

from __future__ import annotations

__all__ = ["ApiError", "error_body"]


class ApiError(Exception):
  """A request this server answers with an error: HTTP `status`, OpenAI's error fields."""

  def __init__(self, message: str, param: str | None = None, *, status: int = 400,
               code: str | None = None, kind: str = "invalid_request_error"):
    super().__init__(message)
    self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind


def error_body(error: ApiError) -> dict:
  """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
  return {"error": {"message": error.message, "type": error.kind, "param": error.param,
                    "code": error.code}}
