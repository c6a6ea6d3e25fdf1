"""A small resources server speaking NeMo-Gym's resources-server API: copy it to write your own.

Endpoints (FastAPI; the session is a signed cookie, as NeMo-Gym's Starlette SessionMiddleware):
- `POST /seed_session`, body = the data row: starts an episode; answers `{}` and sets the cookie.
- `POST /calculator`, body = the call's arguments `{"expression": "6*7"}`: a tool; answers the
  result as text. Add a tool by adding a `POST /<tool name>` route.
- `POST /verify`, body = `{**row, "response": <Responses API object>}`: answers the body with
  `reward` (1.0 when the last number of the final message equals the row's `expected_answer`) and
  `reward_components` (`correct`, `used_tool`); `reward` is their weighted sum.

`app.state.verify_calls` counts the verifies answered. For tests, `delay_s` slows every answer and `fail_status` makes `/verify` and the tools answer
that HTTP status (e.g. 500). Run it (optional extra `posttrain[http]`):

    python -m posttrain.environments.resources_server --port 8765
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations (Request) at runtime.
import argparse
import asyncio
import re
import secrets
import socket
import threading
import time
from typing import Any, Optional

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_text(response: dict) -> str:
    """The text of the last assistant message in a Responses API object."""
    for item in reversed(response.get("output") or []):
        if item.get("type") == "message":
            return "".join(part.get("text", "") for part in item.get("content") or [] if isinstance(part, dict))
    return ""


def make_app(delay_s: float = 0.0, fail_status: Optional[int] = None, tool_weight: float = 0.0):
    """The FastAPI app. `tool_weight` (default 0) adds `tool_weight * used_tool` to the reward."""
    try:
        from fastapi import FastAPI, Request, Response
        from starlette.middleware.sessions import SessionMiddleware
    except ImportError:
        raise ImportError("the resources server needs the http extra: pip install 'posttrain[http]'") from None
    from posttrain.environments.tools.builtin import ToolError, format_number, safe_eval

    app = FastAPI(title="posttrain example resources server")
    app.add_middleware(SessionMiddleware, secret_key=secrets.token_hex(16))
    sessions: dict[str, dict[str, Any]] = {}  # session id -> episode state (kept server side)
    app.state.sessions = sessions
    app.state.verify_calls = 0

    async def slow_or_fail() -> Optional[Response]:
        if delay_s:
            await asyncio.sleep(delay_s)
        if fail_status is not None:
            return Response("injected failure", status_code=fail_status)
        return None

    def state(request: Request) -> dict[str, Any]:
        sid = request.session.get("id")
        if sid is None or sid not in sessions:
            sid = request.session["id"] = secrets.token_hex(8)
            sessions[sid] = {"tool_calls": 0}
        return sessions[sid]

    @app.post("/seed_session")
    async def seed_session(request: Request):
        failed = await slow_or_fail()
        if failed is not None:
            return failed
        row = await request.json()
        request.session["id"] = secrets.token_hex(8)
        sessions[request.session["id"]] = {"tool_calls": 0, "row": row}
        return {}

    @app.post("/calculator")
    async def calculator(request: Request):
        failed = await slow_or_fail()
        if failed is not None:
            return failed
        arguments = await request.json()
        state(request)["tool_calls"] += 1
        try:
            return Response(format_number(safe_eval(str(arguments.get("expression", "")))), media_type="text/plain")
        except ToolError as e:
            return Response(f"error: {e}", media_type="text/plain")

    @app.post("/verify")
    async def verify(request: Request):
        failed = await slow_or_fail()
        if failed is not None:
            return failed
        body = await request.json()
        app.state.verify_calls += 1
        numbers = NUMBER.findall(final_text(body.get("response") or {}))
        expected = str(body.get("expected_answer", "")).strip()
        correct = float(bool(numbers) and numbers[-1] == expected)
        used_tool = float(state(request)["tool_calls"] > 0)
        return {**body, "reward": correct + tool_weight * used_tool,
                "reward_components": {"correct": correct, "used_tool": used_tool}}

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """Run an app with uvicorn on 127.0.0.1 in a background thread (tests, notebooks):
    `with ServerThread(make_app()) as url: ...`."""

    def __init__(self, app, port: Optional[int] = None):
        import uvicorn

        self.port = port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"resources server on port {self.port} did not start")
            time.sleep(0.05)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def main(argv: Optional[list[str]] = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--tool-weight", type=float, default=0.0, help="reward bonus for using a tool (default 0)")
    args = parser.parse_args(argv)
    uvicorn.run(make_app(tool_weight=args.tool_weight), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
