"""
A TLS listener next to the plain one, from an ssl: endpoint string in
`listen`, with a certificate the test generates.
"""

from __future__ import annotations

import datetime
import http.client
import socket
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.integration.harness import Daemon, free_port


def self_signed(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def test_plain_and_tls_listeners(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    tls_port = free_port()
    d = Daemon(tmp_path / "d", "")
    text = d.config.read_text().replace(
        f'listen = "tcp:{d.port}:interface=127.0.0.1"',
        f'listen = ["tcp:{d.port}:interface=127.0.0.1", '
        f'"ssl:{tls_port}:interface=127.0.0.1:privateKey={key}:certKey={cert}"]',
    )
    d.config.write_text(text)
    d.start()
    try:
        context = ssl.create_default_context(cafile=str(cert))
        conn = http.client.HTTPSConnection("localhost", tls_port, context=context, timeout=10)
        conn.request("GET", "/health")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("x-blazar-trace-id")
        assert conn.sock.version() in ("TLSv1.2", "TLSv1.3")
        conn.close()
        # a client that does not trust the certificate is refused
        strict = http.client.HTTPSConnection("localhost", tls_port, context=ssl.create_default_context(), timeout=10)
        try:
            strict.request("GET", "/health")
            raise AssertionError("an unverified certificate was accepted")
        except ssl.SSLCertVerificationError:
            pass
        # plain HTTP to the TLS port fails cleanly (no response, no hang)
        with socket.create_connection(("127.0.0.1", tls_port), timeout=5) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            try:
                data = s.recv(100)
            except (ConnectionResetError, socket.timeout):
                data = b""
            assert not data.startswith(b"HTTP/1.1 200")
        assert d.request("GET", "/health")[0] == 200  # the plain listener still serves
    finally:
        d.stop()
        d.kill_everything()
