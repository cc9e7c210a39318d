"""HTTPS for a dashboard bound beyond loopback: the user's certificate, or one made here.

Off loopback the login form carries the mesh token and every request the session cookie, so
they travel over TLS. With ``--dashboard-cert/--dashboard-key`` the user's pair is loaded
(stdlib ``ssl``). Without them a self-signed pair is made once per machine by the ``openssl``
command (no Python dependency for it), kept in ``GPUMESH_HOME`` (key 0600) and reused; its
SHA-256 fingerprint is printed so the user can check the browser's warning page against it.
Without ``openssl`` the dashboard does not start off loopback (``TLSUnavailable`` says how to
go on). Loopback stays plain HTTP: nothing crosses a network there.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

CERT_FILE = "dashboard-cert.pem"
KEY_FILE = "dashboard-key.pem"
CERT_DAYS = 825  # the longest a browser accepts for a server certificate
OPENSSL_SECONDS = 30.0
RENEW_SECONDS = 86400  # a certificate made here is made again this long before it expires


class TLSUnavailable(ConfigError):
    """Off loopback without a certificate, and no ``openssl`` to make one."""


@dataclass(frozen=True)
class Certificate:
    cert: Path
    key: Path
    fingerprint: str  # SHA-256 of the DER certificate, as browsers show it (AB:CD:...)
    generated: bool  # made by this start (False: the user's, or one made before)


def fingerprint(cert: Path) -> str:
    """The SHA-256 fingerprint of the first certificate in a PEM file."""
    pem = cert.read_text(encoding="ascii", errors="replace")
    start = pem.index("-----BEGIN CERTIFICATE-----")
    end = pem.index("-----END CERTIFICATE-----", start) + len("-----END CERTIFICATE-----")
    digest = hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem[start:end])).hexdigest().upper()
    return ":".join(digest[i:i + 2] for i in range(0, len(digest), 2))


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A server context for the pair; ConfigError naming the file when it does not load."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"cannot use the dashboard certificate {cert} with key {key}: {exc}. "
                          "Give a PEM certificate and its unencrypted PEM key") from exc
    return context


def names_for(host: str) -> tuple[list[str], list[str]]:
    """(DNS names, IP addresses) a certificate for a bind to ``host`` covers: this machine's
    name (as ``gethostname()`` says it, no DNS lookup), localhost, loopback and the bind
    address itself when it is one."""
    hostname = socket.gethostname().lower()
    dns = [n for n in dict.fromkeys([hostname, f"{hostname}.local", "localhost"]) if n]
    ips = ["127.0.0.1", "::1"]
    bare = host.strip("[]")
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:
        if bare and bare != "*" and bare.lower() not in dns:
            dns.insert(0, bare.lower())
    else:
        if not address.is_unspecified and str(address) not in ips:
            ips.insert(0, str(address))
    return dns, ips


def _covers(cert: Path, dns: list[str], ips: list[str]) -> bool:
    """Whether a certificate made before names all of ``dns`` and ``ips`` (read by openssl)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return True  # cannot tell; a mismatch only adds to the browser's warning
    try:
        # -checkend fails the command for a certificate that expires within a day: made
        # again, rather than served expired after its 825 days.
        out = subprocess.run([openssl, "x509", "-noout", "-checkend", str(RENEW_SECONDS),
                              "-ext", "subjectAltName", "-in", str(cert)], capture_output=True,
                             text=True, timeout=OPENSSL_SECONDS, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    have: set[str] = set()
    for part in out.replace("\n", ",").split(","):
        kind, _, value = part.strip().partition(":")
        if kind == "DNS":
            have.add(value.lower())
        elif kind == "IP Address":
            try:
                have.add(str(ipaddress.ip_address(value)))
            except ValueError:
                continue
    return {*dns, *(str(ipaddress.ip_address(i)) for i in ips)} <= have


def self_signed(home: Path, host: str, *, remake: bool = False) -> Certificate:
    """The machine's self-signed pair in ``home``: reused when it covers ``host`` and is not
    about to expire (unless ``remake``), made by ``openssl`` otherwise. TLSUnavailable when
    it has to be made and openssl is missing."""
    cert, key = home / CERT_FILE, home / KEY_FILE
    dns, ips = names_for(host)
    if not remake and cert.is_file() and key.is_file() and _covers(cert, dns, ips):
        try:
            kept = Certificate(cert, key, fingerprint(cert), generated=False)
        except (OSError, ValueError):
            pass  # damaged: made again below
        else:
            os.chmod(key, 0o600)
            return kept
    openssl = shutil.which("openssl")
    if openssl is None:
        raise TLSUnavailable(
            f"the dashboard on {host} would be plain HTTP, and 'openssl' is not installed to "
            "make it a certificate: pass --dashboard-cert FILE --dashboard-key FILE, or keep it "
            "on loopback (the default) and reach it with 'ssh -L 8265:127.0.0.1:8265 HOST'")
    alt = ",".join([*(f"DNS:{n}" for n in dns), *(f"IP:{i}" for i in ips)])
    # Made in a private folder, then moved in whole: the key is never readable by others,
    # and a start that fails half-way leaves nothing to reuse.
    with tempfile.TemporaryDirectory(dir=home, prefix=".dashboard-tls-") as scratch:
        new_cert, new_key = Path(scratch) / CERT_FILE, Path(scratch) / KEY_FILE
        try:
            subprocess.run(
                [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt",
                 "ec_paramgen_curve:prime256v1", "-nodes", "-sha256", "-days", str(CERT_DAYS),
                 "-subj", f"/CN={dns[0]}/O=gpumesh dashboard", "-addext",
                 f"subjectAltName={alt}", "-keyout", str(new_key), "-out", str(new_cert)],
                stdin=subprocess.DEVNULL, capture_output=True, text=True,
                timeout=OPENSSL_SECONDS, check=True)
        except subprocess.CalledProcessError as exc:
            raise ConfigError(f"openssl could not make the dashboard's certificate: "
                              f"{(exc.stderr or '').strip()[-300:]}") from exc
        except (OSError, subprocess.SubprocessError) as exc:
            raise ConfigError(f"openssl could not make the dashboard's certificate: {exc}"
                              ) from exc
        os.chmod(new_key, 0o600)
        os.chmod(new_cert, 0o644)
        os.replace(new_key, key)
        os.replace(new_cert, cert)
    return Certificate(cert, key, fingerprint(cert), generated=True)


def prepare(host: str, home: Path, cert: str | None, key: str | None
            ) -> tuple[ssl.SSLContext, Certificate] | None:
    """TLS for a dashboard bound to ``host``: None on loopback without a certificate given;
    otherwise the context and the certificate it serves. ConfigError (TLSUnavailable) when
    there is none to be had."""
    from .guard import is_loopback

    if (cert is None) != (key is None):
        raise ConfigError("give both --dashboard-cert and --dashboard-key, or neither")
    if cert is not None and key is not None:
        context = server_context(Path(cert), Path(key))  # loads it, or says why not
        return context, Certificate(Path(cert), Path(key), fingerprint(Path(cert)), False)
    if is_loopback(host):
        return None
    from ..config import ensure_home

    chosen = self_signed(ensure_home(home), host)
    try:
        return server_context(chosen.cert, chosen.key), chosen
    except ConfigError:
        if chosen.generated:
            raise
        # A pair made here before that does not load: damaged, or the key of one start and
        # the certificate of another that made theirs at the same moment. Made again.
        chosen = self_signed(home, host, remake=True)
        return server_context(chosen.cert, chosen.key), chosen
