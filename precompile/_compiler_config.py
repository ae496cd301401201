"""The compiler settings this process compiles under, as cache keys read them: the
inductor and functorch configs besides their defaults, the environment variables their
modules read, and the attention backends variants are compiled with."""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from precompile.runtime import InvalidOptionError

from . import _torch_adapter as adapter
from ._attention_policy import key_factor as attention_key_factor
from ._attention_policy import sdpa_switches

log = logging.getLogger("precompile.compile")


def codegen_config_digest() -> str:
    """sha256 of what the inductor and functorch configs hold besides their defaults (by
    value, as ``save_config_portable`` exports them), the environment variables their
    modules read, and the attention backends variants are compiled with.

    A config module not imported holds its defaults, and the environment sets those
    defaults only through the variables it reads: where none of them is set, the digest
    is computed without importing inductor, whose package imports Dynamo (5-10 s on a
    GPU host). A serving process that never imported the compiler so looks its model up
    without importing it, under the key a build process with the same configs computed."""
    environment = _config_environment()
    changed: dict[str, Any] = {}
    for name in adapter.CONFIG_MODULES:
        config = sys.modules.get(name)
        if config is None and environment:
            log.info("the cache key imports %s: the environment sets %s", name, sorted(environment))
            config = importlib.import_module(name)
        if config is not None:
            differing = _non_defaults(config)
            if differing:
                changed[name] = differing
    snapshot = {
        "changed": changed,
        "environment": environment,
        # the attention kernels variants are compiled with
        "sdpa": attention_key_factor(sdpa_switches()),
    }
    text = json.dumps(snapshot, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def caller_switch(options: Mapping[str, Any] | None, name: str) -> bool | None:
    """The caller's True or False for inductor's ``name`` in ``options['config_patches']``,
    None where they did not set it. Any other value is refused, naming it: inductor would
    read 0 as False and "False" as True."""
    patches = options.get("config_patches") if isinstance(options, Mapping) else None
    if not isinstance(patches, Mapping) or name not in patches:
        return None
    value = patches[name]
    if not isinstance(value, bool):
        raise InvalidOptionError(
            f"options['config_patches'][{name!r}] must be True or False, got {value!r:.60}"
        )
    return value


def compile_configs() -> dict[str, dict[str, Any]]:
    """The imported config modules' entries besides their defaults, by module name: what
    ``codegen_config_digest`` reads of them, for another process to set."""
    configs = {}
    for name in adapter.CONFIG_MODULES:
        config = sys.modules.get(name)
        if config is not None:
            configs[name] = _non_defaults(config)
    return configs


def inductor_config_changes() -> frozenset[str]:
    """The inductor config entries this process holds at other than their defaults (none
    where inductor's config is not imported and no variable of its is set)."""
    config = sys.modules.get(adapter.INDUCTOR_CONFIG)
    if config is None and _config_environment():
        config = importlib.import_module(adapter.INDUCTOR_CONFIG)
    return frozenset(_non_defaults(config)) if config is not None else frozenset()


def _non_defaults(config: Any) -> dict[str, Any]:
    """The config module's portable entries whose value is not their default (all of them
    where this torch's config module does not say what a default is)."""
    portable = adapter.config_values(config)
    defaults = adapter.config_defaults(config)
    if defaults is None:
        return portable
    return {k: v for k, v in portable.items() if k not in defaults or v != defaults[k]}


# Names the config modules read only to name this process's logs (a launcher such as
# torchrun sets ROLE_RANK per rank): they change no compiled code, and in the key they
# would give each rank its own entry.
_LOG_ONLY_NAMES = frozenset(
    {
        "ROLE_RANK",
        "MAST_HPC_JOB_NAME",
        "LOG_TLPARSE",
        "TORCHINDUCTOR_WORKER_LOGPATH",
        "TORCHINDUCTOR_WORKER_SUPPRESS_LOGGING",
        "INDUCTOR_LOG_URL_FOR_GRAPH_XFORM",
        "TORCHINDUCTOR_AUTOHEURISTIC_LOG_PATH",
        "TORCHINDUCTOR_TRITON_PROTON_OUTPUT_DIR",
    }
)


@functools.lru_cache(maxsize=1)
def _config_environment_names() -> frozenset[str]:
    """Every environment variable name the config modules' source spells as a string,
    but those read only to name logs."""
    return frozenset(adapter.config_environment_names() - _LOG_ONLY_NAMES)


def _config_environment() -> dict[str, str]:
    """The environment variables that can set the configs' defaults, as set now."""
    names = _config_environment_names()
    return {key: value for key, value in sorted(os.environ.items()) if key in names}
