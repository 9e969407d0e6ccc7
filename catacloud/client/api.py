"""A small client of the REST API (``/api/v1/``) on ``requests``: Bearer token, JSON, and the
API's ``{code, detail}`` errors raised as :class:`ApiError`."""

from __future__ import annotations

from collections.abc import Iterator
from importlib import metadata
from typing import Any

import requests

from catacloud.client.config import ClientConfig

TIMEOUT = (10, 60)  # connect, read (seconds)


def client_version() -> str:
    """The installed distribution's version. Not ``catacloud.__version__``: with the
    catacloud-agent distribution installed too, ``catacloud`` may be a namespace package whose
    ``__init__`` never runs (editable installs)."""
    try:
        return metadata.version("catacloud")
    except metadata.PackageNotFoundError:
        return "unknown"


class ApiError(Exception):
    """The API said no (``status``, ``code``, ``detail``, ``fields``), or could not be reached
    (``status`` 0)."""

    def __init__(self, status: int, code: str, detail: str, fields: dict | None = None) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail, self.fields = status, code, detail, fields or {}

    @property
    def transient(self) -> bool:
        """Worth trying again while waiting (the server restarting, a proxy's 502, throttled)."""
        return self.status == 0 or self.status >= 500 or self.status == 429

    def as_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"status": self.status, "code": self.code, "detail": self.detail}
        if self.fields:
            body["fields"] = self.fields
        return body


class BearerAuth(requests.auth.AuthBase):
    """The token as ``Authorization: Bearer``. Given as the session's ``auth`` (not a default
    header), so a ~/.netrc entry for the host cannot replace it, and ``requests`` drops it when
    a redirect leaves the API's host (a presigned artifact URL)."""

    def __init__(self, token: str) -> None:
        self.token = token

    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        request.headers["Authorization"] = f"Bearer {self.token}"
        return request


# Whether a server answered this process yet (any HTTP answer): until one has, an unreachable
# server is a wrong URL or a server that is down, said at once rather than retried.
_answered = False


def answered() -> bool:
    return _answered


class Api:
    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.session = requests.Session()
        self.session.auth = BearerAuth(config.token)
        self.session.headers.update(
            {"Accept": "application/json", "User-Agent": f"catacloud-cli/{client_version()}"}
        )

    def _url(self, path: str) -> str:
        return f"{self.config.api}/{path.lstrip('/')}"

    def request(
        self, method: str, path: str, *, json: Any = None, params: Any = None, headers: Any = None
    ) -> Any:
        response = self._send(method, path, json=json, params=params, headers=headers)
        if response.status_code == 204 or not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            raise ApiError(
                response.status_code, "bad_response", f"the server answered {_snippet(response)}"
            ) from None

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: Any = None, *, headers: dict[str, str] | None = None) -> Any:
        return self.request("POST", path, json=body if body is not None else {}, headers=headers)

    def patch(self, path: str, body: Any) -> Any:
        return self.request("PATCH", path, json=body)

    def put(self, path: str, body: Any) -> Any:
        return self.request("PUT", path, json=body)

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)

    def download(self, path: str) -> tuple[requests.Response, Iterator[bytes]]:
        """A streamed GET (redirects to a presigned URL are followed; ``requests`` drops the
        Authorization header when the redirect leaves the API's host)."""
        response = self._send("GET", path, stream=True, accept="*/*")
        return response, response.iter_content(chunk_size=1 << 16)

    def _send(
        self,
        method: str,
        path: str,
        *,
        stream: bool = False,
        accept: str | None = None,
        headers: dict[str, str] | None = None,
        **kw: Any,
    ):
        headers = {**(headers or {}), **({"Accept": accept} if accept else {})} or None
        try:
            response = self.session.request(
                method, self._url(path), timeout=TIMEOUT, stream=stream, headers=headers, **kw
            )
        except requests.RequestException as exc:
            reason = exc.__class__.__name__
            raise ApiError(0, "unreachable", f"cannot reach {self.config.url} ({reason})") from None
        global _answered
        _answered = True
        if response.status_code >= 400:
            raise _error(response)
        return response

    def pages(self, path: str, *, limit: int, **params: Any) -> list[dict]:
        """Up to ``limit`` rows of a paginated list."""
        rows: list[dict] = []
        offset = 0
        while len(rows) < limit:
            page = self.get(path, limit=min(100, limit - len(rows)), offset=offset, **params)
            rows += page["results"]
            offset += len(page["results"])
            if not page.get("next") or not page["results"]:
                break
        return rows


def _snippet(response: requests.Response) -> str:
    text = response.text.strip().replace("\n", " ")
    ctype = response.headers.get("Content-Type", "?")
    return f"HTTP {response.status_code} ({ctype}): {text[:200]}" if text else f"HTTP {response.status_code}"


def _error(response: requests.Response) -> ApiError:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and "detail" in body:
        return ApiError(
            response.status_code, str(body.get("code") or "error"), str(body["detail"]), body.get("fields")
        )
    return ApiError(response.status_code, "http_error", f"the server answered {_snippet(response)}")
