"""Certificates for tests of stores over TLS: a CA made for the run (``trustme``)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TlsFiles", "make_tls"]

HOST = "127.0.0.1"


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a server serving its clients over TLS, and for one client."""

    ca: Path  # the CA that signed the server's and the client's certificates
    server_cert: Path
    server_key: Path
    server_pem: Path  # the server's key and certificate in one file (Java's PEM key store)
    client_cert: Path  # a client certificate with common name "keymutex-client"
    client_key: Path
    client_cert_auth: bool = False  # the server asks clients for a certificate

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(str(self.client_cert), str(self.client_key))
        return context


def make_tls(directory: Path, *, client_cert_auth: bool = False) -> TlsFiles:
    """A fresh CA, a certificate for 127.0.0.1 and a client certificate, as PEM files."""
    import trustme

    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    server = ca.issue_cert(HOST, "localhost")
    client = ca.issue_cert("keymutex-client", common_name="keymutex-client")
    files = TlsFiles(
        ca=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server-key.pem",
        server_pem=directory / "server-key-and-cert.pem",
        client_cert=directory / "client.pem",
        client_key=directory / "client-key.pem",
        client_cert_auth=client_cert_auth,
    )
    server_chain = b"".join(blob.bytes() for blob in server.cert_chain_pems)
    ca.cert_pem.write_to_path(str(files.ca))
    server.private_key_pem.write_to_path(str(files.server_key))
    server.cert_chain_pems[0].write_to_path(str(files.server_cert))
    files.server_pem.write_bytes(_pkcs8(server.private_key_pem.bytes()) + server_chain)
    client.private_key_pem.write_to_path(str(files.client_key))
    client.cert_chain_pems[0].write_to_path(str(files.client_cert))
    return files


def _pkcs8(key_pem: bytes) -> bytes:
    """The key in PKCS#8 (``BEGIN PRIVATE KEY``), the one PEM form Java reads."""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(key_pem, password=None)
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
