"""Never compile in production: ``compile=False`` or ``PRECOMPILE_OFFLINE=1`` (like
huggingface_hub's ``local_files_only``) turns a cache miss into an error that names the
key and what differs from the nearest entry, instead of a compile on a serving machine."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NoReturn

from precompile.cache import ArtifactCache, env_flag
from precompile.runtime import ArtifactNotFoundError, InvalidOptionError


def is_offline(compile: bool) -> bool:
    if not isinstance(compile, bool):
        raise InvalidOptionError(f"compile must be True or False, got {compile!r}")
    return not compile or env_flag("PRECOMPILE_OFFLINE", default=False)


def refuse(
    store: ArtifactCache | None,
    key: str,
    factors: Mapping[str, str],
    unused_because: str | None = None,
) -> NoReturn:
    """Raise the offline miss. ``unused_because``: why an entry under ``key`` itself did
    not serve (a changed source file the key cannot see), said instead of its factors."""
    where = "no cache" if store is None else f"cache {store.root}"
    if store is not None and store.remote is not None:
        where += f" (and its remote {store.remote})"
    if unused_because is not None:
        found = f"{where} has entry {key[:12]}, but it did not serve: {unused_because}"
    else:
        found = f"{where} has no entry {key[:12]}"
        found += "" if store is None else f"; {store.explain_miss(key, factors)}"
    raise ArtifactNotFoundError(
        f"compiling is off (compile=False or PRECOMPILE_OFFLINE=1) and {found}", key=key
    )
