"""Content-addressed on-disk store of precompile entries, safe across processes.

It stores documents and blobs and names them (tags); building an artifact from an entry
is the runtime's job (``CompiledArtifact.load(key=..., tag=...)``).
"""

# The folder cache/ is the package precompile.cache. A checkout's root on sys.path makes it
# importable as "cache" too: a second copy of every module, whose patches and state the
# real one never sees. Refused, by name.
if __name__ != "precompile.cache":
    raise ImportError(f"import precompile.cache, not {__name__}: cache/ is that package's folder")

from ._bytes import (
    TEMP_PREFIX,
    atomic_file,
    check_payload_size,
    compress,
    decompress,
    hold,
    read_bounded,
    remove_abandoned_temps,
    sha256_hex,
    symlink_refused,
)
from ._default import CacheOption, cache_to_read, default_cache, resolve_cache
from ._entry import (
    CacheEntry,
    CacheScan,
    CacheStats,
    MissExplanation,
    PrunePlan,
    RemoteScan,
    StoredEntry,
    VerifiedBlobs,
    VerifyReport,
)
from ._errors import (
    ArtifactAccessError,
    CacheRootError,
    CacheWriteError,
    CorruptArtifactError,
    InvalidOptionError,
    PayloadLimitError,
    PrecompileError,
    UnsafeCacheError,
    UntrustedArtifactError,
)
from ._fsspec_store import FsspecStore
from ._get_or_build import get_or_build
from ._json import decode_json
from ._remote_store import RemoteStore
from ._root import LAYOUT, resolve_root
from ._settings import env_flag
from ._signing import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Signature,
    TrustedKeysOption,
    check_own_signature,
    check_signature,
    generate_signing_key,
    key_id,
    private_key,
    resolve_trusted_keys,
    sign_digest,
)
from ._store import DEFAULT_SIZE_LIMIT, ArtifactCache

# The basics the layers above share (checked bytes, bounded JSON, settings, signatures)
# are part of this face: the runtime and the compile side import nothing else of ours.
__all__ = [
    "PUBLIC_KEY_BYTES",
    "SIGNATURE_BYTES",
    "Signature",
    "TrustedKeysOption",
    "TEMP_PREFIX",
    "atomic_file",
    "hold",
    "remove_abandoned_temps",
    "check_payload_size",
    "check_own_signature",
    "check_signature",
    "compress",
    "decode_json",
    "decompress",
    "env_flag",
    "generate_signing_key",
    "key_id",
    "private_key",
    "read_bounded",
    "resolve_trusted_keys",
    "sha256_hex",
    "sign_digest",
    "symlink_refused",
    "DEFAULT_SIZE_LIMIT",
    "LAYOUT",
    "ArtifactAccessError",
    "ArtifactCache",
    "CacheEntry",
    "CacheOption",
    "CacheRootError",
    "CacheScan",
    "CacheStats",
    "CacheWriteError",
    "CorruptArtifactError",
    "FsspecStore",
    "PayloadLimitError",
    "InvalidOptionError",
    "MissExplanation",
    "PrecompileError",
    "PrunePlan",
    "RemoteScan",
    "RemoteStore",
    "StoredEntry",
    "UnsafeCacheError",
    "UntrustedArtifactError",
    "VerifiedBlobs",
    "VerifyReport",
    "cache_to_read",
    "default_cache",
    "get_or_build",
    "resolve_cache",
    "resolve_root",
]
