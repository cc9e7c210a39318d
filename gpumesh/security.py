"""Token to CURVE keys, the ZAP allow-list, and the mesh fingerprint.

The token never crosses the wire. Both sides derive the same two Curve25519 keypairs from it
(HKDF-SHA256, after scrypt for tokens too short to trust): the coordinator's server pair and one
client pair shared by every worker and client. The coordinator's ZAP handler admits only the
derived client public key, so a peer must hold the token to complete a handshake, and it must
also hold it to know the server key it encrypts to: authentication is mutual.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass, field

import zmq
import zmq.auth.thread
from zmq.utils import z85

from .errors import ConfigError, MeshError

ZAP_DOMAIN = "gpumesh"
_SALT = b"gpumesh/v1"
# Tokens shorter than this (about 192 bits of urlsafe base64) are stretched with scrypt first,
# so a hand-chosen passphrase costs an offline guesser real work per guess.
STRONG_TOKEN_CHARS = 32


@dataclass(frozen=True)
class MeshKeys:
    """Everything derived from one token. ``repr`` hides the secrets."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)
    fingerprint: str


def _hkdf(key_material: bytes, info: bytes, length: int = 32) -> bytes:
    """RFC 5869 HKDF-SHA256 (extract then expand), enough for a few 32-byte subkeys."""
    prk = hmac.new(_SALT, key_material, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


def derive_keys(token: str) -> MeshKeys:
    """Derive the mesh's CURVE keypairs and public fingerprint from the token."""
    if not token or not token.strip():
        raise ConfigError("the token is empty: pass --token or set GPUMESH_TOKEN")
    require_curve()
    material = token.encode("utf-8")
    if len(token) < STRONG_TOKEN_CHARS:
        material = hashlib.scrypt(material, salt=_SALT, n=2**14, r=8, p=1, dklen=32)
    server_secret = z85.encode(_hkdf(material, b"curve-server"))
    client_secret = z85.encode(_hkdf(material, b"curve-client"))
    return MeshKeys(
        server_public=zmq.curve_public(server_secret),
        server_secret=server_secret,
        client_public=zmq.curve_public(client_secret),
        client_secret=client_secret,
        fingerprint=_hkdf(material, b"fingerprint", 6).hex(),
    )


def require_curve() -> None:
    """Refuse to run on a libzmq without CURVE: there is no unencrypted fallback."""
    if not zmq.has("curve"):
        raise MeshError(
            f"this libzmq ({zmq.zmq_version()}) was built without CURVE encryption, which gpumesh "
            "requires: reinstall pyzmq from its wheels (pip install --force-reinstall pyzmq)"
        )


def configure_server(sock: zmq.Socket, keys: MeshKeys) -> None:
    """Make ``sock`` a CURVE server guarded by the ZAP domain. Call before ``bind``."""
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()


def configure_client(sock: zmq.Socket, keys: MeshKeys) -> None:
    """Make ``sock`` a CURVE client of the mesh's coordinator. Call before ``connect``."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


class _AllowMeshClient:
    """ZAP credentials provider: admit exactly the client key derived from the token."""

    def __init__(self, keys: MeshKeys) -> None:
        self._allowed = keys.client_public

    def callback(self, domain: str, client_key: bytes) -> bool:
        return domain == ZAP_DOMAIN and hmac.compare_digest(client_key, self._allowed)


def start_authenticator(ctx: zmq.Context, keys: MeshKeys) -> zmq.auth.thread.ThreadAuthenticator:
    """Start the one ZAP handler of this context. It must run before the server socket binds."""
    auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=logging.getLogger("gpumesh.zap"))
    # zmq.auth logs client keys at DEBUG; keep it quiet even under -v.
    auth.log.setLevel(logging.WARNING)
    auth.start()
    auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_AllowMeshClient(keys))
    return auth
