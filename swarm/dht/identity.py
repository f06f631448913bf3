"""A peer's identity: one RSA key that is both its libp2p identity and its DHT signing key.

hivemind's identity files hold an RSA key (libp2p protobuf around DER), and the libp2p peer id is the sha256
multihash of the public key. Signing DHT records with that same key lets a reader check that a record's
`peer_id` really belongs to the key that signed it.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

import base58
import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

_OWNER_RE = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)


def ensure_identity_file(path: str | Path | None) -> tuple[Path, bool]:
    """Return (identity path, is_temporary); create a new identity if the file does not exist.

    With no path, the identity lives in a temporary file the caller deletes on shutdown.
    """
    if path is None:
        fd, tmp = tempfile.mkstemp(prefix="flowswarm-identity-", suffix=".key")
        os.close(fd)
        os.unlink(tmp)  # hivemind writes the file itself, read-only
        P2P.generate_identity(tmp)
        return Path(tmp), True
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
    return path, False


def load_private_key(path: str | Path) -> RSAPrivateKey:
    """The RSA key inside a hivemind identity file, as hivemind's signing key type."""
    try:
        proto = crypto_pb2.PrivateKey.FromString(Path(path).read_bytes())
        key = serialization.load_der_private_key(proto.data, password=None)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read identity file {path}: {e}") from e
    if proto.key_type != crypto_pb2.KeyType.RSA or not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError(f"identity file {path} does not hold an RSA key")
    private_key = RSAPrivateKey.__new__(RSAPrivateKey)  # hivemind's constructor always generates a new key
    private_key._private_key = key
    return private_key


def peer_id_of_public_key(public_key: RSAPublicKey) -> str:
    """The base58 libp2p peer id of an RSA public key (sha256 multihash of the protobuf public key)."""
    der = public_key._public_key.public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    proto = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(proto).digest(), multihash.coerce_code("sha2-256"))
    return str(base58.b58encode(digest).decode())


def owner_peer_id(subkey: object) -> str | None:
    """The peer id of the "[owner:...]" key in a DHT subkey, or None if it has none or a malformed one."""
    if not isinstance(subkey, bytes):
        return None
    keys = _OWNER_RE.findall(subkey)
    if len(keys) != 1:
        return None
    try:
        return peer_id_of_public_key(RSAPublicKey.from_bytes(keys[0]))
    except ValueError:
        return None
