"""A throwaway certificate authority for the TLS tests, made with the ``openssl`` command:
a CA certificate and server certificates it signs for chosen names (EC P-256 keys, valid
two days), as PEM files in a directory."""

from __future__ import annotations

import ipaddress
import shutil
import ssl
import subprocess
from pathlib import Path

__all__ = ["CertAuthority", "have_openssl", "server_context"]


def have_openssl() -> bool:
    return shutil.which("openssl") is not None


def _openssl(*args: str, cwd: Path) -> None:
    run = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {run.stderr.strip()[-800:]}")


class CertAuthority:
    """``CertAuthority(dir, "name")``: ``ca_file`` (the CA's certificate, what
    ``smtp_tls_CAfile`` names) and ``issue(names)``."""

    def __init__(self, directory: Path, name: str = "queue-ref test CA") -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ca_file = self.dir / "ca.pem"
        self._key = self.dir / "ca.key"
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                 "-nodes", "-days", "2", "-subj", f"/CN={name}", "-keyout", str(self._key),
                 "-out", str(self.ca_file), "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=self.dir)
        self._serial = 0

    def issue(self, names: list[str], stem: str = "") -> tuple[Path, Path]:
        """A server certificate for ``names`` (DNS names, or IP addresses) signed by this
        CA, its CN the first name: (certificate file, key file)."""
        self._serial += 1
        stem = stem or f"server{self._serial}"
        cert, key, csr, ext = (self.dir / f"{stem}{s}" for s in (".pem", ".key", ".csr", ".ext"))
        sans = ",".join(_subject_alt_name(n) for n in names)
        ext.write_text(f"subjectAltName={sans}\nbasicConstraints=CA:FALSE\n"
                       "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
                       "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")
        _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                 "-nodes", "-subj", f"/CN={names[0]}", "-keyout", str(key), "-out", str(csr),
                 cwd=self.dir)
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(self.ca_file), "-CAkey",
                 str(self._key), "-set_serial", str(1000 + self._serial), "-days", "2",
                 "-extfile", str(ext), "-out", str(cert), cwd=self.dir)
        return cert, key


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A server-side context for an aiosmtpd STARTTLS (client certificates not asked)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(cert), str(key))
    return ctx


def _subject_alt_name(name: str) -> str:
    try:
        return f"IP:{ipaddress.ip_address(name)}"
    except ValueError:
        return f"DNS:{name}"
