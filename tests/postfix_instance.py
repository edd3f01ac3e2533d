"""A private Postfix instance on loopback, for the tests and the relay benchmark:
``postfix -c DIR`` with its own main.cf, master.cf, queue and log file, no chroot, its
smtpd on a port of 127.0.0.1, everything it does not deliver itself sent to a relayhost.

Optional parts: a TLS server certificate (``tls``), Cyrus SASL for its smtpd
(``sasl_users``: a sasldb made with ``saslpasswd2``, PLAIN and LOGIN through the auxprop
plugin), and any main.cf setting (``settings``; a value ``{d}`` is the instance's
directory).  ``texthash:`` tables (client credentials, TLS policy, transport) are
written with ``table``.  Debian's packages: postfix, sasl2-bin, libsasl2-modules.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

__all__ = ["PrivatePostfix", "ensure_postfix", "free_port", "instance_dir", "postfix_missing",
           "wait_port"]

#: main.cf of every instance; ``settings`` override and extend it
BASE_SETTINGS = {
    "compatibility_level": "3.6",
    "queue_directory": "{d}/spool",
    "data_directory": "{d}/data",
    "mail_owner": "postfix",
    "setgid_group": "postdrop",
    "inet_interfaces": "127.0.0.1",
    "inet_protocols": "ipv4",
    "myhostname": "postfix-test.localdomain",
    "mydestination": "",
    "mynetworks": "127.0.0.0/8",
    "smtp_dns_support_level": "disabled",
    "maillog_file": "{d}/maillog",
    "maillog_file_prefixes": "{d}",
    "alias_maps": "",
    "alias_database": "",
    "local_recipient_maps": "",
    "smtpd_relay_restrictions": "permit_mynetworks, reject_unauth_destination",
}
_SASL_CONF = """\
pwcheck_method: auxprop
auxprop_plugin: sasldb
sasldb_path: {db}
mech_list: PLAIN LOGIN
"""


def postfix_missing() -> str:
    """What this machine lacks to run a private Postfix with SASL ("" when nothing)."""
    for b in ("postfix", "saslpasswd2"):
        if not (shutil.which(b) or os.path.exists(f"/usr/sbin/{b}")):
            return f"{b} is not installed (Debian: postfix, sasl2-bin, libsasl2-modules)"
    if os.geteuid() != 0:
        return "a private Postfix is started as root"
    return ""


def ensure_postfix() -> None:
    """Postfix's binaries (postfix, smtp-source, smtp-sink), installed if missing."""
    if all(shutil.which(b) or os.path.exists(f"/usr/sbin/{b}")
           for b in ("postfix", "smtp-source", "smtp-sink")):
        return
    if os.geteuid() != 0:
        sys.exit("Postfix is not installed and installing it needs root: apt-get install postfix")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["debconf-set-selections"], input=b"postfix postfix/main_mailer_type "
                   b"select No configuration\n", check=True)
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env)
    subprocess.run(["apt-get", "-o", "DPkg::Lock::Timeout=600", "install", "-y", "-q",
                    "postfix"], check=True, env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_port(port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the relay exited with {proc.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def instance_dir(prefix: str = "queue-ref-postfix-") -> Path:
    """A new directory under /tmp that Postfix's unprivileged processes can reach
    (pytest's own are mode 0700); the caller removes it."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    return path


class PrivatePostfix:
    """``with PrivatePostfix(dir, relayhost="[127.0.0.1]:2526") as pf:`` ... ``pf.port``.
    ``dir`` and its parents must be searchable by the postfix user (``instance_dir``)."""

    def __init__(self, directory: Path, relayhost: str, settings: dict[str, str] | None = None,
                 tls: tuple[Path, Path] | None = None,
                 sasl_users: dict[str, str] | None = None, port: int = 0) -> None:
        self.dir = directory
        self.etc = directory / "etc"
        self.relayhost = relayhost
        self.settings = dict(settings or {})
        self.tls = tls
        self.sasl_users = dict(sasl_users or {})
        self.port = port
        self.pid = 0

    def table(self, name: str, entries: dict[str, str]) -> str:
        """A ``texthash:`` table in the instance's etc directory (call before ``start``)."""
        self.etc.mkdir(parents=True, exist_ok=True)
        path = self.etc / name
        path.write_text("".join(f"{k} {v}\n" for k, v in entries.items()))
        return f"texthash:{path}"

    def _main_cf(self) -> str:
        s = dict(BASE_SETTINGS)
        s["relayhost"] = self.relayhost
        if self.tls is not None:
            s.update(smtpd_tls_cert_file=str(self.tls[0]), smtpd_tls_key_file=str(self.tls[1]),
                     smtpd_tls_security_level="may", smtpd_tls_loglevel="1")
        if self.sasl_users:
            s.update(smtpd_sasl_auth_enable="yes", smtpd_sasl_type="cyrus",
                     smtpd_sasl_path="smtpd", cyrus_sasl_config_path=str(self.etc / "sasl"),
                     smtpd_sasl_security_options="noanonymous",
                     smtpd_sasl_local_domain=s["myhostname"])
        s.update(self.settings)
        return "".join(f"{k} = {v.format(d=self.dir)}\n" for k, v in s.items())

    def _sasldb(self) -> None:
        sasl = self.etc / "sasl"  # Debian's Postfix reads CONFIG_DIRECTORY/sasl/ only
        shutil.rmtree(sasl, ignore_errors=True)
        sasl.mkdir()
        db = sasl / "sasldb2"
        realm = self.settings.get("myhostname", BASE_SETTINGS["myhostname"])
        for user, password in self.sasl_users.items():
            run = subprocess.run(["saslpasswd2", "-f", str(db), "-c", "-p", "-u", realm, user],
                                 input=password.encode(), capture_output=True)
            if run.returncode != 0:
                raise RuntimeError(f"saslpasswd2 failed: {run.stderr.decode().strip()}")
        (sasl / "smtpd.conf").write_text(_SASL_CONF.format(db=db))
        shutil.chown(db, "root", "postfix")  # smtpd reads it as postfix
        db.chmod(0o640)

    def _master_cf(self) -> None:
        shutil.copy("/etc/postfix/master.cf", self.etc / "master.cf")
        with contextlib.suppress(OSError):
            shutil.copy("/etc/postfix/dynamicmaps.cf", self.etc / "dynamicmaps.cf")
        lines = []
        for line in (self.etc / "master.cf").read_text().splitlines():
            f = line.split()
            if f and not line[0].isspace() and not line.startswith("#") and len(f) >= 8:
                if f[0] == "smtp" and f[1] == "inet":
                    f[0] = f"127.0.0.1:{self.port}"
                if f[4] == "y" or f[4] == "-":
                    f[4] = "n"  # no chroot: the private queue is not under a chroot
                line = "  ".join(f[:8]) + ("  " + " ".join(f[8:]) if f[8:] else "")
            lines.append(line)
        (self.etc / "master.cf").write_text("\n".join(lines) + "\n")

    def start(self) -> int:
        """Start the instance; its SMTP port once it listens."""
        for sub in ("spool", "data"):
            shutil.rmtree(self.dir / sub, ignore_errors=True)
            (self.dir / sub).mkdir(parents=True)
        self.etc.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        self._master_cf()
        if self.sasl_users:
            self._sasldb()
        (self.etc / "main.cf").write_text(self._main_cf())
        if os.geteuid() == 0:
            shutil.chown(self.dir / "data", "postfix")
        run = subprocess.run(["postfix", "-c", str(self.etc), "start"], capture_output=True)
        if run.returncode != 0:
            raise RuntimeError(f"postfix did not start: {run.stderr.decode()[-1000:]} "
                               f"{self.maillog()[-2000:]}")
        wait_port(self.port, 30)
        self.pid = int((self.dir / "spool" / "pid" / "master.pid").read_text().split()[0])
        return self.port

    def stop(self) -> None:
        """Stop the instance and wait (up to 10 s) until its master is gone."""
        if not self.pid:
            return
        subprocess.run(["postfix", "-c", str(self.etc), "stop"], capture_output=True)
        for _ in range(100):
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        self.pid = 0

    def maillog(self) -> str:
        path = self.dir / "maillog"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_log(self, text: str, timeout: float = 10.0) -> str:
        """The log once it holds ``text`` (or as it is after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while text not in (log := self.maillog()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return log

    def __enter__(self) -> PrivatePostfix:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
