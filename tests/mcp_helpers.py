"""Helpers of the MCP tests (test_mcp.py, test_mcp_workouts.py): one session of the official
MCP Python SDK's client (the reference client nobody here wrote) over stdio (``python -m
healthlog mcp``) or Streamable HTTP (``serve``'s /mcp), and a tool's answer checked.
Importing it skips the importing module where the SDK is missing (it needs Python 3.10)."""

import asyncio
import contextlib
import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, TOKEN, assert_no_leaks

# The SDK is imported where a session starts, not here: every xdist worker imports every
# test module to collect it, and the SDK takes a second of CPU to import.
if sys.version_info < (3, 10) or importlib.util.find_spec("mcp") is None:
    pytest.skip("the MCP SDK (test extra) needs Python 3.10 or newer", allow_module_level=True)

#: The two ways a client meets the server: the stdio handshake, and HTTP at 2026-07-28.
TRANSPORTS = [pytest.param(("stdio", "legacy"), id="stdio-handshake"),
              pytest.param(("http", "auto"), id="http-2026")]


def environment() -> dict:
    return {"PYTHONPATH": os.environ["PYTHONPATH"]}


@contextlib.asynccontextmanager
async def http_transport(address: tuple, headers: dict = None):
    """Streamable HTTP to ``serve``'s /mcp with the token (the SDK's own HTTP client)."""
    sent = {"Authorization": "Bearer " + TOKEN}
    sent.update(headers or {})
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    async with create_mcp_http_client(headers=sent) as http:
        async with streamable_http_client("http://%s:%d/mcp" % address,
                                          http_client=http) as streams:
            yield streams


def stdio_transport(data_dir: Path, errlog):
    from mcp.client.stdio import StdioServerParameters, stdio_client

    return stdio_client(StdioServerParameters(
        command=sys.executable, args=["-m", "healthlog", "mcp", "--data", str(data_dir)],
        env=environment(), cwd=str(ROOT)), errlog=errlog)


class SdkSession:
    """What one SDK session saw: the negotiated version, the server's identity and
    instructions, the tools listed and each call's result."""

    def __init__(self, transport: str, mode: str):
        self.transport, self.mode = transport, mode
        self.version = self.info = self.instructions = None
        self.tools: list = []
        self.results: list = []
        self.log: list = []


async def _converse(transport, mode: str, calls: list, out: SdkSession) -> None:
    from mcp.client import Client
    from mcp.shared.exceptions import MCPError

    async with Client(transport, mode=mode) as client:
        out.version, out.info = client.protocol_version, client.server_info
        out.instructions = client.instructions
        out.tools = (await client.list_tools()).tools
        for name, arguments in calls:
            try:
                out.results.append(await client.call_tool(name, arguments))
            except MCPError as exc:
                out.results.append(exc)


def converse(store, transport: str, calls: list = (), mode: str = "auto",
             tmp_path: Path = None) -> SdkSession:
    """One SDK session over ``transport`` (``stdio`` or ``http``): the tools listed, then
    each ``(tool, arguments)`` called in order.  The stdio server's log is kept and checked
    for leaks."""
    out = SdkSession(transport, mode)
    if transport == "http":
        asyncio.run(_converse(http_transport(store.address), mode, list(calls), out))
        return out
    log_path = (tmp_path or store.data_dir.parent) / ("mcp-stdio-%d.log" % time.monotonic_ns())
    with open(str(log_path), "w") as errlog:
        asyncio.run(_converse(stdio_transport(store.data_dir, errlog), mode, list(calls), out))
    out.log = [line for line in log_path.read_text().splitlines() if line]
    assert_no_leaks(out.log)
    return out


def answer(result) -> dict:
    """A tool's structured answer, checked to be a success with its text rendering."""
    assert not isinstance(result, Exception), result
    assert result.is_error is False, result.content
    assert result.content and result.content[0].type == "text" and result.content[0].text
    return result.structured_content
