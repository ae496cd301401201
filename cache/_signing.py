"""Signed artifacts: Ed25519 signatures over an artifact's index digest.

Loading an artifact runs its code. The digests an artifact carries prove it is intact,
not who made it. A signature does: the signer's private key signs the sha256 of the
artifact's index (binary), of its ``manifest.json`` (unpacked) or of its cache entry
document, and each of those holds the sha256 of every payload and kernel. With trusted
keys configured (``trusted_keys=`` or ``$PRECOMPILE_TRUSTED_KEYS``), an artifact that is
unsigned, signed by another key, or whose signature does not match is refused with
:class:`UntrustedArtifactError` before any byte of it is unpickled or imported.

Uses ``cryptography`` (``pip install 'precompile[sign]'``), imported only when a key is
given or configured.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._errors import CorruptArtifactError, InvalidOptionError, UntrustedArtifactError

DOMAIN = b"precompile-artifact-signature-v1\0"
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
TrustedKeysOption = Sequence[Any] | str | None


@dataclass(frozen=True)
class Signature:
    public_key: bytes  # raw Ed25519 public key
    signature: bytes  # over DOMAIN + the signed digest

    @property
    def key_id(self) -> str:
        return key_id(self.public_key)

    def to_json(self) -> dict[str, str]:
        return {"public_key": self.public_key.hex(), "signature": self.signature.hex()}

    @staticmethod
    def from_json(value: Any, where: str) -> Signature:
        try:
            public = bytes.fromhex(value["public_key"])
            signature = bytes.fromhex(value["signature"])
        except (TypeError, KeyError, ValueError):
            raise UntrustedArtifactError(f"{where} has a malformed signature") from None
        if len(public) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
            raise UntrustedArtifactError(f"{where} has a malformed signature")
        return Signature(public, signature)


def key_id(public_key: bytes) -> str:
    """A short name of a public key for messages: 16 hex digits of its sha256."""
    return hashlib.sha256(public_key).hexdigest()[:16]


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise InvalidOptionError(
            "signing and verifying artifacts needs the 'cryptography' package: "
            "pip install 'precompile[sign]'"
        ) from None
    return ed25519


def _read_key_file(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read(1 << 16)
    except OSError as exc:
        raise InvalidOptionError(f"cannot read key file {path!r}: {exc.strerror}") from None


def private_key(value: Any) -> Any:
    """An Ed25519 private key from a PEM file path, PEM bytes, or a key object."""
    ed25519 = _crypto()
    if isinstance(value, ed25519.Ed25519PrivateKey):
        return value
    from cryptography.hazmat.primitives import serialization

    data = _read_key_file(os.fspath(value)) if isinstance(value, (str, os.PathLike)) else value
    if not isinstance(data, bytes):
        raise InvalidOptionError(f"signing_key must be a PEM file path or PEM bytes, got {value!r}")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise InvalidOptionError(
            f"signing_key is not an unencrypted PEM private key: {exc}"
        ) from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise InvalidOptionError("signing_key must be an Ed25519 key")
    return key


def public_key_bytes(value: Any) -> bytes:
    """Raw public key bytes from 64 hex digits, a PEM file path, PEM bytes or a key."""
    if isinstance(value, bytes) and len(value) == PUBLIC_KEY_BYTES:
        return value
    if isinstance(value, str) and len(value) == 2 * PUBLIC_KEY_BYTES:
        try:
            return bytes.fromhex(value)
        except ValueError:
            pass
    ed25519 = _crypto()
    from cryptography.hazmat.primitives import serialization

    if isinstance(value, ed25519.Ed25519PrivateKey):
        value = value.public_key()
    if not isinstance(value, ed25519.Ed25519PublicKey):
        data = _read_key_file(os.fspath(value)) if isinstance(value, (str, os.PathLike)) else value
        if not isinstance(data, bytes):
            raise InvalidOptionError(f"trusted key must be hex, a PEM file or PEM bytes: {value!r}")
        try:
            value = serialization.load_pem_public_key(data)
        except ValueError:
            value = private_key(data).public_key()
    if not isinstance(value, ed25519.Ed25519PublicKey):
        raise InvalidOptionError("trusted keys must be Ed25519 keys")
    raw: bytes = value.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return raw


def resolve_trusted_keys(option: TrustedKeysOption) -> tuple[bytes, ...] | None:
    """The keys a load must see a signature of: ``option``, else the os.pathsep-separated
    list in ``$PRECOMPILE_TRUSTED_KEYS`` (files or hex); None where neither is set (no
    signature is required)."""
    if option is None:
        text = os.environ.get("PRECOMPILE_TRUSTED_KEYS", "").strip()
        if not text:
            return None
        option = [part for part in text.split(os.pathsep) if part.strip()]
    if isinstance(option, (str, bytes, os.PathLike)):
        option = [option]
    keys = tuple(public_key_bytes(item) for item in option)
    if not keys:
        raise InvalidOptionError("trusted_keys is empty: give at least one key, or None")
    return keys


def sign_digest(digest: bytes, key: Any) -> Signature:
    signer = private_key(key)
    from cryptography.hazmat.primitives import serialization

    public = signer.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    return Signature(public, signer.sign(DOMAIN + digest))


def check_signature(
    digest: bytes, signature: Signature | None, trusted: tuple[bytes, ...] | None, where: str
) -> None:
    """Refuse ``where`` unless it is signed over ``digest`` by one of ``trusted`` (no-op
    when no keys are configured)."""
    if trusted is None:
        return
    if signature is None:
        raise UntrustedArtifactError(
            f"{where} is not signed, and trusted keys are configured; sign it with "
            "`precompile sign --key KEY` or save it with signing_key="
        )
    if signature.public_key not in trusted:
        known = ", ".join(key_id(k) for k in trusted)
        raise UntrustedArtifactError(
            f"{where} is signed by key {signature.key_id}, which is not among the trusted "
            f"keys ({known})"
        )
    ed25519 = _crypto()
    from cryptography.exceptions import InvalidSignature

    try:
        ed25519.Ed25519PublicKey.from_public_bytes(signature.public_key).verify(
            signature.signature, DOMAIN + digest
        )
    except InvalidSignature:
        raise UntrustedArtifactError(
            f"{where}'s signature by key {signature.key_id} does not match its contents"
        ) from None


def check_own_signature(digest: bytes, signature: Signature | None, where: str) -> bool | None:
    """Whether ``signature`` signs ``digest`` by the key it names, with no trusted keys
    configured: a slot that does not is corrupt (``CorruptArtifactError``). True where it
    held; None where there is none, or ``cryptography`` is not installed to check it (a
    load needs no ``cryptography`` unless keys are configured)."""
    if signature is None:
        return None
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        return None
    try:
        public = ed25519.Ed25519PublicKey.from_public_bytes(signature.public_key)
        public.verify(signature.signature, DOMAIN + digest)
    except (InvalidSignature, ValueError):
        raise CorruptArtifactError(
            f"{where} carries a signature by key {signature.key_id} that does not match its "
            "contents: the file is corrupt or was altered"
        ) from None
    return True


def generate_signing_key(path: str) -> str:
    """Write a new Ed25519 private key to ``path`` (PEM, mode 0600) and its public key to
    ``path + '.pub'``; return the public key's hex."""
    ed25519 = _crypto()
    from cryptography.hazmat.primitives import serialization

    key = ed25519.Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public = key.public_key()
    public_pem = public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(private_pem)
    with open(path + ".pub", "wb") as handle:
        handle.write(public_pem)
    return public_key_bytes(public).hex()
