"""Certificates and a Bearer-token service for the test registry (tests/support/registry.py), on 127.0.0.1.

    with TokenServer(tmp, users={"alice": "pw"}) as ts:           # docker token auth (distribution's `auth: token`)
        with Registry(token=ts) as reg: ...                      # the registry trusts ts.cert_path

    cert, key = self_signed(tmp, "127.0.0.1")                    # a TLS certificate for Registry(tls=...)

The token service answers GET /token?service=&scope=... : HTTP Basic checked against USERS (anonymous gets a
token without access), then an RS256 JWT whose x5c header carries the signing certificate, as distribution 2.8
verifies it against `rootcertbundle`. `requests` counts the calls; `auth_seen` how many carried credentials.
"""
from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

ISSUER = "mm-test-token-issuer"
SERVICE = "mm-test-registry"


def self_signed(directory: Path, host: str = "127.0.0.1", name: str = "mm-test") -> tuple[Path, Path]:
    """(certificate PEM, key PEM) for HOST (an IP SAN), valid for a day; the certificate is its own CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenServer:
    def __init__(self, directory: Path, users: dict[str, str]):
        self.users = dict(users)
        self.cert_path, self.key_path = self_signed(Path(directory), name="mm-test-token")
        self.service, self.issuer = SERVICE, ISSUER
        self.requests = 0
        self.auth_seen = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                server._answer(self)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self.realm = f"{self.url}/token"

    def _answer(self, h: BaseHTTPRequestHandler) -> None:
        with self._lock:
            self.requests += 1
        parts = urlsplit(h.path)
        query = parse_qs(parts.query)
        user = ""
        auth = h.headers.get("Authorization", "")
        if auth:
            with self._lock:
                self.auth_seen += 1
            try:
                user, _, password = base64.b64decode(auth.split(" ", 1)[1]).decode().partition(":")
            except (ValueError, IndexError, UnicodeDecodeError):
                user, password = "", None
            if auth.split(" ", 1)[0] != "Basic" or self.users.get(user) != password:
                body = b'{"details":"invalid credentials"}'
                h.send_response(401)
                h.send_header("Content-Length", str(len(body)))
                h.end_headers()
                h.wfile.write(body)
                return
        access = []
        for scope in query.get("scope", []):
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            if kind == "repository" and user:
                access.append({"type": "repository", "name": name, "actions": actions.split(",")})
        token = self._jwt(user, access)
        body = json.dumps({"token": token, "access_token": token, "expires_in": 300}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _jwt(self, subject: str, access: list) -> str:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import padding

        cert = x509.load_pem_x509_certificate(self.cert_path.read_bytes())
        key = serialization.load_pem_private_key(self.key_path.read_bytes(), password=None)
        header = {"typ": "JWT", "alg": "RS256",
                  "x5c": [base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()]}
        now = int(time.time())
        claims = {"iss": self.issuer, "sub": subject, "aud": self.service, "exp": now + 300, "nbf": now - 10,
                  "iat": now, "jti": secrets.token_hex(8), "access": access}
        signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
        signature = key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing_input}.{_b64(signature)}"

    def __enter__(self) -> "TokenServer":
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
