"""``sdcguard serve`` with TLS, and its refusal of a PostgreSQL schema not at head."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from db import upgrade
from detection.transport.signing import signed_headers
from tests.fixtures_db import PostgresServer
from tests.flows.conftest import WEBHOOK_SECRET, alarm_payload
from tests.flows.test_webhook_serve import _free_port

ROOT = Path(__file__).resolve().parents[3]


def _self_signed(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.mark.slow
def test_serve_speaks_https_with_tls_cert_and_key(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    port = _free_port()
    env = {
        **os.environ,
        "SDCGUARD_WEBHOOK_SECRET": WEBHOOK_SECRET,
        "SDCGUARD_DATABASE_URL": f"sqlite:///{tmp_path / 'ledger.db'}",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "serve",
            "--port",
            str(port),
            "--trigger",
            "none",
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"https://127.0.0.1:{port}"
    context = ssl.create_default_context(cafile=str(cert))
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(base + "/healthz", verify=context, timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "sdcguard serve did not come up"
                time.sleep(0.2)
        body = httpx.Request("POST", base, json=alarm_payload()).content
        headers = {
            **signed_headers("default", WEBHOOK_SECRET, "POST", "/v1/alarms", body),
            "Content-Type": "application/json",
        }
        response = httpx.post(
            base + "/v1/alarms", content=body, headers=headers, verify=context, timeout=30
        )
        assert response.status_code == 202, response.text
        with pytest.raises(httpx.TransportError):  # plain HTTP is not served
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)


@pytest.mark.slow
def test_serve_refuses_a_postgres_schema_not_at_head(postgres_server: PostgresServer) -> None:
    url = postgres_server.create_database("sdcguard_serve_head")
    try:
        upgrade(url, "0001")
        env = {
            **os.environ,
            "SDCGUARD_WEBHOOK_SECRET": WEBHOOK_SECRET,
            "SDCGUARD_DATABASE_URL": url,
        }
        proc = subprocess.run(
            [sys.executable, "-m", "flows.cli", "serve", "--port", str(_free_port())],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2
        assert "not at head" in proc.stderr
        assert "sdcguard db upgrade" in proc.stderr
    finally:
        postgres_server.drop_database(url)
