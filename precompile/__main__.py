"""The ``precompile`` command line (also ``python -m precompile``).

    precompile cache ls|info|verify|prune|clear|stats|explain|tags|sign|push|pull   the cache
    precompile keygen KEYFILE                 a new Ed25519 key pair (KEYFILE, KEYFILE.pub)
    precompile sign --key KEYFILE PATH        sign a saved artifact (file or directory)
    precompile verify [--key PUB ...] PATH    check a saved artifact's digests and signature

It imports the cache and the artifact formats only: no Dynamo, no inductor compile
modules. Errors are one line on stderr (exit 2); a failed check exits 1. The commands
that read (``ls``, ``info``, ``explain``, ``verify``, ``stats``, ``tags``) change no
entry's last use and no count.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from precompile.cache import (
    ArtifactCache,
    CacheEntry,
    CorruptArtifactError,
    RemoteStore,
    UntrustedArtifactError,
    generate_signing_key,
    key_id,
    private_key,
    resolve_root,
    resolve_trusted_keys,
)
from precompile.runtime import IncompatibleArtifactError, PrecompileError
from precompile.runtime.compiler_interface import EntrySummary, summarize_entry


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1024 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PB"


def _ago(timestamp: float) -> str:
    seconds = max(0.0, time.time() - timestamp)
    for unit, width in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= width:
            return f"{seconds / width:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def _fail(message: str) -> NoReturn:
    """An error: one line on stderr, exit 2."""
    print(f"precompile: {message}", file=sys.stderr)
    raise SystemExit(2)


def _byte_count(text: str) -> int:
    """``--max-size``: a number of bytes, 0 or more (-5 planned to evict everything)."""
    if text.startswith("-") and re.fullmatch(r"-[0-9]+", text, re.ASCII):
        raise argparse.ArgumentTypeError(f"expected a number of bytes >= 0, got {text}")
    # int() takes " 5", "1_000", "+5" and digits of other scripts
    if not re.fullmatch(r"[0-9]+", text, re.ASCII):
        raise argparse.ArgumentTypeError(f"expected a number of bytes (digits), got {text!r}")
    return int(text)


def _emit(data: Any, as_json: bool, text: str) -> None:
    print(json.dumps(data, indent=2, default=str) if as_json else text)


def _find(store: ArtifactCache, prefix: str) -> CacheEntry:
    scan = store.scan()
    matches = [e for e in scan.entries if e.key.startswith(prefix)]
    if len(matches) == 1:
        return matches[0]
    unreadable = [
        (path, reason)
        for path, reason in scan.unreadable
        if os.path.basename(path).startswith(prefix)
    ]
    if not matches and len(unreadable) == 1:
        path, reason = unreadable[0]
        _fail(f"could not read entry {path}: {reason}")
    if not matches:
        _fail(f"no entry's key starts with {prefix!r} in this cache")
    _fail(f"key prefix {prefix!r} matches {len(matches)} entries; give more digits")


def _summary(store: ArtifactCache, entry: CacheEntry) -> EntrySummary:
    """What ``entry`` holds; an entry whose document cannot be read (evicted since the
    scan, say) is summarized from its factors and ``about`` alone."""
    try:
        document = store.document(entry.key)
    except (OSError, PrecompileError):
        document = None
    return summarize_entry(document, entry.factors, entry.about)


def _printable(text: str, limit: int = 120) -> str:
    """Text from a file, safe on a terminal (no control characters) and kept short."""
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _what(summary: EntrySummary) -> str:
    blocks = f"; compiled once: {summary.blocks}" if summary.blocks else ""
    if summary.kind == "model":
        name = (summary.name or "?").rsplit(".", 1)[-1]  # the class, not its module path
        return _printable(f"model {name} ({summary.config or '?'}{blocks})")
    if summary.kind == "graph":
        return _printable(f"graph {summary.name or '?'}" + (f" ({blocks[2:]})" if blocks else ""))
    return "?"


def _inputs_text(summary: EntrySummary, shown: int = 3) -> str:
    """The graph's inputs, those with dynamic sizes first (a model's graph lists its
    parameters among them): at most ``shown``, then how many more."""
    if summary.inputs is None:
        return "?"
    symbols = {name for point in (*(summary.hints or ()), *(summary.sizes or ())) for name in point}
    dynamic = [i for i in summary.inputs if any(s in i for s in symbols)]
    ordered = dynamic + [i for i in summary.inputs if i not in dynamic]
    more = len(ordered) - shown
    return _printable(", ".join(ordered[:shown]) + (f", +{more} more" if more > 0 else ""))


def _points_text(points: Sequence[Mapping[str, int]]) -> str:
    if all(len(p) == 1 for p in points) and len({next(iter(p)) for p in points}) == 1:
        name = next(iter(points[0]))
        return f"{name}=" + ",".join(str(p[name]) for p in points)
    return ", ".join("(" + ", ".join(f"{k}={v}" for k, v in p.items()) + ")" for p in points)


def _variants_text(summary: EntrySummary) -> str:
    if summary.hints is None or summary.sizes is None:
        return "?"
    if not summary.hints and all(not p for p in summary.sizes):
        return "static"  # no dynamic dims: one variant
    parts = [f"hints {_points_text(summary.hints)}"] if summary.hints else []
    parts += [f"sizes {_points_text(summary.sizes)}"] if summary.sizes else []
    return _printable("; ".join(parts))


def _table(
    header: list[str], rows: list[list[str]], shrink: Sequence[int] = (), width: int | None = None
) -> list[str]:
    """Columns as wide as their widest cell (a row may run past the header's last one);
    where the table is wider than ``width`` (the terminal's, ``$COLUMNS``), the columns
    ``shrink`` names give up characters, their cells cut with "...", down to 12 each."""
    widths = [max([len(h), *(len(r[n]) for r in rows)]) for n, h in enumerate(header)]
    width = shutil.get_terminal_size((200, 24)).columns if width is None else width
    for n in shrink:
        excess = sum(widths) + 2 * (len(widths) - 1) - width
        if excess <= 0:
            break
        widths[n] = max(len(header[n]), 12, widths[n] - excess)
        rows = [[_cut(c, widths[n]) if i == n else c for i, c in enumerate(row)] for row in rows]
    return [
        "  ".join(
            cell.ljust(widths[n]) if n < len(widths) else cell for n, cell in enumerate(row)
        ).rstrip()
        for row in [header, *rows]
    ]


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _plan_text(plan: Any, verb: str) -> str:
    action = f"would {verb}" if plan.dry_run else verb.replace("evict", "evicted")
    lines = [
        f"{action} {len(plan.evicted)} entries, {len(plan.blobs)} unreferenced blobs and "
        f"{len(plan.temp_files)} stale temp files: {_size(plan.bytes_freed)} of "
        f"{_size(plan.size_before)} (limit {_size(plan.size_limit)})"
    ]
    lines += [f"  entry {key[:16]}" for key in plan.evicted]
    lines += [f"  could not read {problem}" for problem in plan.problems]
    return "\n".join(lines)


def _remote_options(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        _fail(f"--remote-options must be JSON, got {text!r}")
    if not isinstance(value, dict):
        _fail(f"--remote-options must be a JSON object, got {text!r}")
    return value


# ``module:attr`` (dotted names on both sides), as uvicorn and gunicorn name an app
_OBJECT_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", re.ASCII)


def _remote(spec: str | None, options_text: str | None) -> tuple[Any, dict[str, Any] | None]:
    """``--remote``/``REMOTE`` and ``--remote-options`` as ``ArtifactCache`` takes them. A
    URL goes as it is (fsspec opens it with the options). ``module:attr`` is imported (the
    current directory first on the path): a ``RemoteStore`` is used as it is; a class or
    other callable is called with the options as keyword arguments and must return one
    (``ArtifactCache`` says what a wrong object lacks). Anything else, a plain path say,
    goes as it is, for the cache to refuse with its reason."""
    options = _remote_options(options_text)
    if not spec or "://" in spec or not _OBJECT_SPEC.fullmatch(spec):
        return spec or None, options
    module_name, attribute = spec.split(":")
    if os.getcwd() not in sys.path:  # the console script does not put it there; -m does
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        _fail(f"remote {spec}: cannot import {module_name}: {exc}")
    for part in attribute.split("."):
        if not hasattr(target, part):
            _fail(f"remote {spec}: {module_name} has no {attribute}")
        target = getattr(target, part)
    if isinstance(target, type) or (callable(target) and not isinstance(target, RemoteStore)):
        try:
            return target(**(options or {})), None
        except Exception as exc:  # the user's factory: its failure, said in one line
            _fail(f"remote {spec}: making the store failed: {type(exc).__name__}: {exc}")
    if options is not None:
        _fail(f"remote {spec} is a store already made: --remote-options configure a factory")
    return target, None


def _report_skipped(skipped: Sequence[tuple[str, str]]) -> None:
    for name, reason in skipped:
        print(f"precompile: skipped {name!r}: {reason}", file=sys.stderr)


def _sync_command(store: ArtifactCache, args: argparse.Namespace) -> int:
    """push / pull: copy entries (and tags) between this cache and its remote. A name
    that is not a key, or a local entry that cannot be read, is skipped and reported
    (stderr, and ``skipped`` in --json) and the rest goes on; the exit status is 1 only
    where an entry that could be copied was not (or there was nothing to copy)."""
    skipped: list[tuple[str, str]] = []
    keys: list[str | None]
    if args.action == "push" and args.tag and store.tagged(args.tag) is None:
        _fail(f"no tag {args.tag!r} in {store.root} (see 'cache tags')")
    if args.action == "push":
        if args.tag:
            keys = [store.tagged(args.tag)]
        else:
            scan = store.scan()
            keys = [e.key for e in scan.entries]
            skipped += [(os.path.basename(path), why) for path, why in scan.unreadable]
        done = []
        for key in keys:
            try:
                if key is not None and store.upload(key):
                    done.append(key)
            except (PrecompileError, OSError) as exc:  # this entry, not the others
                skipped.append((key or "", f"{type(exc).__name__}: {exc}"))
        if args.tag and done:
            store.tag(args.tag, done[0])
    else:
        # A pull reads the remote and writes only here: the remote's own tag decides.
        listing = store.remote_scan()
        if listing.error is not None:
            _fail(f"listing {args.remote} failed: {listing.error}")
        if args.tag:
            key, error = store.remote_tagged(args.tag)
            if error is not None:
                _fail(f"reading tag {args.tag!r} of {args.remote} failed: {error}")
            if key is None:
                _fail(f"no tag {args.tag!r} in {args.remote}")
            keys = [key]
        else:
            keys = list(listing.keys)
            skipped += listing.skipped
        done = store.pull([k for k in keys if k is not None])
        if args.tag and done:
            store.tag(args.tag, done[0], to_remote=False)
    _report_skipped(skipped)
    verb = "pushed" if args.action == "push" else "pulled"
    wanted = [k for k in keys if k is not None and k not in {name for name, _ in skipped}]
    failed = len(wanted) - len(done)
    text = f"{verb} {len(done)} entries {'to' if verb == 'pushed' else 'from'} {args.remote}"
    text += f"; {failed} failed" if failed else ""
    text += f"; {len(skipped)} skipped" if skipped else ""
    report = {
        verb: done,
        "failed": failed,
        "skipped": [{"name": name, "reason": why} for name, why in skipped],
    }
    _emit(report, args.json, text)
    return 0 if not failed and wanted else 1


def _list_entries(store: ArtifactCache, as_json: bool) -> None:
    """``cache ls``: what each entry holds (a graph's name and inputs, a model's class and
    config), its variants, device, size, last use and tags; the most recently used first."""
    scan = store.scan()
    entries = sorted(scan.entries, key=lambda e: e.last_used, reverse=True)
    names: dict[str, list[str]] = {}
    for name, key in sorted(store.tags().items()):
        names.setdefault(key, []).append(name)
    listed = [(e, _summary(store, e), names.get(e.key, [])) for e in entries]
    header = ["KEY", "WHAT", "INPUTS", "VARIANTS", "DEVICE", "SIZE", "LAST USED", "TAGS"]
    cells = [
        [e.key[:12], _what(s), _inputs_text(s), _variants_text(s), s.device or "?",
         _size(e.size), _ago(e.last_used), ", ".join(t) or "-"]
        + (["signed"] if e.signed else [])
        for e, s, t in listed
    ]  # fmt: skip
    rows = _table(header, cells, shrink=(1, 2, 3))  # WHAT, INPUTS, VARIANTS give way
    rows.append(
        f"{len(entries)} entries, {_size(sum(e.size for e in entries))} in {store.root}"
        + ("" if store.writable else " (read-only)")
    )
    rows += [f"could not read {path}: {reason}" for path, reason in scan.unreadable]
    report = [{**dataclasses.asdict(e), **s.to_json(), "tags": t} for e, s, t in listed]
    _emit(report, as_json, "\n".join(rows))


# What a command does to a cache directory that does not exist: the commands that only
# read answer for an empty cache and create nothing; the others make it.
_READS = frozenset({"ls", "info", "explain", "verify", "stats", "tags"})


def _cache_command(args: argparse.Namespace) -> int:
    remote = getattr(args, "remote", None)
    root = resolve_root(args.root)
    dry = args.action in ("prune", "clear") and (
        args.dry_run or not args.yes if args.action == "clear" else args.dry_run
    )
    signing_key = private_key(args.key) if args.action == "sign" else None  # readable first
    if (args.action in _READS or dry) and not remote and not os.path.lexists(root):
        if args.action == "clear" and not args.yes and not args.dry_run:
            _fail("'cache clear' deletes every entry; add --yes")
        return _no_cache(args, root)
    if args.action == "sign" and not remote and not os.path.lexists(root):
        _fail(f"no cache at {root}: nothing to sign")
    store_remote, remote_options = _remote(remote, getattr(args, "remote_options", None))
    store = ArtifactCache(
        args.root,
        trust_foreign=args.trust_foreign,
        remote=store_remote,
        remote_options=remote_options,
    )
    if args.action in ("push", "pull"):
        return _sync_command(store, args)
    if args.action == "ls" and remote:
        listing = store.remote_scan()
        if listing.error is not None:
            _fail(f"listing {remote} failed: {listing.error}")
        _report_skipped(listing.skipped)
        keys = list(listing.keys)
        _emit(
            keys, args.json, "\n".join(k[:12] for k in keys) + f"\n{len(keys)} entries in {remote}"
        )
        return 0
    if not store.writable and args.action in ("prune", "clear", "sign") and not dry:
        raise SystemExit(
            f"precompile: cache {store.root} is read-only: cannot {args.action} it "
            "(entries can still be listed, verified and loaded)"
        )
    if args.action == "ls":
        _list_entries(store, args.json)
    elif args.action == "info":
        entry = _find(store, args.key)
        text = "\n".join(
            [
                f"key       {entry.key}",
                f"size      {_size(entry.size)}",
                f"blobs     {len(entry.blobs)}",
                f"signed    {'yes' if entry.signed else 'no'}",
                f"created   {_ago(entry.created)}",
                f"last used {_ago(entry.last_used)}",
                "factors:",
            ]
            + [f"  {name:15} {value}" for name, value in sorted(entry.factors.items())]
        )
        _emit(dataclasses.asdict(entry), args.json, text)
    elif args.action == "verify":
        report = store.verify(quarantine=args.quarantine)
        problems = [f"  could not check {path}: {reason}" for path, reason in report.unreadable]
        intact = report.intact
        where = (
            "moved to quarantine" if report.quarantined
            else "left in place (--quarantine moves them aside)"
        )  # fmt: skip
        text = f"checked {report.checked} entries: " + (
            "all intact"
            if report.ok
            else f"{max(intact, 0)} intact"
            + (
                f", {len(report.corrupt)} corrupt, {where}: "
                + ", ".join(k[:12] for k in report.corrupt)
                if report.corrupt
                else ""
            )
            + (f", {len(report.unreadable)} could not be checked" if report.unreadable else "")
        )
        _emit(dataclasses.asdict(report), args.json, "\n".join([text, *problems]))
        return 0 if report.ok else 1
    elif args.action == "prune":
        plan = store.prune(args.max_size, dry_run=args.dry_run)
        _emit(dataclasses.asdict(plan), args.json, _plan_text(plan, "evict"))
    elif args.action == "clear":
        if not args.yes and not args.dry_run:
            _fail("'cache clear' deletes every entry; add --yes")
        plan = store.clear(dry_run=args.dry_run)
        _emit(dataclasses.asdict(plan), args.json, _plan_text(plan, "remove"))
    elif args.action == "stats":
        stats = store.stats()
        text = (
            f"{stats.entries} entries, {_size(stats.size)} of {_size(stats.size_limit)}; "
            f"hits {stats.hits}, misses {stats.misses}, evictions {stats.evictions}, "
            f"corrupt {stats.corrupt}" + ("" if stats.writable else "; read-only")
        )
        _emit(dataclasses.asdict(stats), args.json, text)
    elif args.action == "explain":
        entry = _find(store, args.key)
        others = [e for e in store.entries() if e.key != entry.key]
        if not others:
            _emit({"nearest": None}, args.json, "no other entry to compare with")
            return 0
        explanation = ArtifactCache.explain_against(entry.key, entry.factors, others)
        _emit(dataclasses.asdict(explanation), args.json, str(explanation))
    elif args.action == "tags":
        tags = store.tags()
        present = {e.key for e in store.entries()}
        lines = [
            f"{n:30s} {k[:16]}{'' if k in present else '  (entry gone)'}" for n, k in tags.items()
        ]
        _emit(tags, args.json, "\n".join(lines) or "no tags")
    elif args.action == "sign":
        keys = [e.key for e in store.entries()] if not args.keys else [
            _find(store, prefix).key for prefix in args.keys
        ]  # fmt: skip
        for key in keys:
            store.sign(key, signing_key)
        _emit({"signed": keys}, args.json, f"signed {len(keys)} entries")
    return 0


def _sign_command(args: argparse.Namespace) -> int:
    # Import time: the artifact formats are for sign and verify; ``cache ls`` and the
    # other cache commands start without them.
    from precompile.runtime.compiler_interface import sign_binary, sign_unpacked

    path = args.path
    key = private_key(args.key)
    signature = sign_unpacked(path, key) if os.path.isdir(path) else sign_binary(path, key)
    print(f"signed {path} with key {signature.key_id}")
    return 0


def _no_cache(args: argparse.Namespace, root: str) -> int:
    """A read command's answer where no cache exists at ``root`` (nothing is created)."""
    if args.action in ("info", "explain"):
        _fail(f"no cache at {root} (nothing was compiled into it yet)")
    nothing = {"dry_run": True, "evicted": [], "blobs": [], "temp_files": [], "bytes_freed": 0}
    empty: dict[str, Any] = {
        "ls": [], "tags": {}, "verify": {"checked": 0, "corrupt": [], "unreadable": []},
        "stats": {"entries": 0, "size": 0}, "prune": nothing, "clear": nothing,
    }  # fmt: skip
    _emit(empty[args.action], args.json, f"no cache at {root} (nothing was compiled into it yet)")
    return 0


def _verify_command(args: argparse.Namespace) -> int:
    from precompile.runtime.compiler_interface import read_binary, read_unpacked

    trusted = resolve_trusted_keys(args.key or None)
    path = args.path
    if not os.path.lexists(path):
        _fail(f"no artifact at {path!r}: no such file or directory")
    if os.path.isdir(path):
        manifest, payloads, signature = read_unpacked(path, trusted)
    else:
        manifest, payloads, signature = read_binary(path, trusted)
    for digest in manifest.payload_digests:
        payloads.read(digest)  # decompress and check every payload; nothing is unpickled
    who = f"signed by key {signature.key_id}" if signature else "not signed"
    if trusted:
        checked = "signature checked against the trusted keys"
    elif signature and importlib.util.find_spec("cryptography") is not None:
        checked = "no trusted keys given; the signature matches the key it names"
    elif signature:
        checked = "no trusted keys given; the signature was not checked (no cryptography)"
    else:
        checked = "no trusted keys given"
    print(f"{path}: intact ({len(manifest.payload_digests)} payloads), {who}; {checked}")
    return 0


def _keygen_command(args: argparse.Namespace) -> int:
    public = generate_signing_key(args.keyfile)
    print(f"wrote private key {args.keyfile} (mode 0600) and public key {args.keyfile}.pub")
    print(f"key id (what verify and errors call it): {key_id(bytes.fromhex(public))}")
    print(f"public key (hex, for PRECOMPILE_TRUSTED_KEYS): {public}")
    return 0


_REMOTE = (
    "an fsspec URL (s3://bucket/path, file:///shared/dir, ...) or module:attr naming a "
    "RemoteStore, or a class or function that makes one"
)
_REMOTE_OPTIONS = "JSON object: a URL's fsspec storage options, or module:attr's keyword arguments"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="precompile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    cache_parser = commands.add_parser("cache", help="inspect and maintain the artifact cache")
    cache_parser.add_argument(
        "--root", help="cache directory (default: $PRECOMPILE_CACHE_DIR or the user cache dir)"
    )
    cache_parser.add_argument(
        "--trust-foreign", action="store_true", help="accept entries other users could write"
    )
    actions = cache_parser.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("ls", help="list entries (--remote REMOTE: the remote's)")
    listing.add_argument("--json", action="store_true")
    listing.add_argument("--remote", help=f"list this remote tier's entries instead: {_REMOTE}")
    listing.add_argument("--remote-options", help=_REMOTE_OPTIONS)
    for name, text in [
        ("push", "upload entries (all, or --tag's) to a remote tier"),
        ("pull", "download entries (all, or --tag's) from a remote tier, verified"),
    ]:
        sync = actions.add_parser(name, help=text)
        sync.add_argument("remote", help=_REMOTE)
        sync.add_argument("--tag", help="only the entry this tag names (and the tag)")
        sync.add_argument("--remote-options", help=_REMOTE_OPTIONS)
        sync.add_argument("--json", action="store_true")
    check = actions.add_parser(
        "verify", help="check every digest (and signature, with trusted keys configured)"
    )
    check.add_argument("--json", action="store_true")
    check.add_argument("--quarantine", action="store_true", help="move corrupt entries aside")
    for name, text in [
        ("stats", "hit/miss/eviction counts and size"),
        ("tags", "named entries (what servers load by name)"),
    ]:
        actions.add_parser(name, help=text).add_argument("--json", action="store_true")
    for name, text in [
        ("info", "one entry and its key factors"),
        ("explain", "which factors differ from the nearest entry"),
    ]:
        sub = actions.add_parser(name, help=text)
        sub.add_argument("key", help="a key or unique prefix")
        sub.add_argument("--json", action="store_true")
    prune = actions.add_parser("prune", help="evict LRU entries down to the size limit")
    prune.add_argument(
        "--max-size", type=_byte_count, help="bytes, >= 0 (default: the cache's limit)"
    )
    prune.add_argument("--dry-run", action="store_true", help="only say what would go")
    prune.add_argument("--json", action="store_true")
    clear = actions.add_parser("clear", help="delete every entry")
    clear.add_argument("--yes", action="store_true", help="confirm")
    clear.add_argument("--dry-run", action="store_true", help="only say what would go")
    clear.add_argument("--json", action="store_true")
    sign_entries = actions.add_parser("sign", help="sign entries (all, or the keys given)")
    sign_entries.add_argument("--key", required=True, help="Ed25519 private key (PEM file)")
    sign_entries.add_argument("keys", nargs="*", help="keys or unique prefixes")
    sign_entries.add_argument("--json", action="store_true")
    keygen = commands.add_parser("keygen", help="write a new Ed25519 key pair")
    keygen.add_argument("keyfile", help="private key file to create (KEYFILE.pub beside it)")
    sign = commands.add_parser("sign", help="sign a saved artifact")
    sign.add_argument("--key", required=True, help="Ed25519 private key (PEM file)")
    sign.add_argument("path", help="a binary artifact file or an unpacked directory")
    verify = commands.add_parser("verify", help="check a saved artifact")
    verify.add_argument("--key", action="append", help="a trusted public key (repeatable)")
    verify.add_argument("path", help="a binary artifact file or an unpacked directory")
    return parser


# What ``verify`` finds wrong with an artifact (exit 1), not a failure to check it.
_CHECK_FAILED = (CorruptArtifactError, UntrustedArtifactError, IncompatibleArtifactError)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handlers = {
        "cache": _cache_command,
        "keygen": _keygen_command,
        "sign": _sign_command,
        "verify": _verify_command,
    }
    try:
        return handlers[args.command](args)
    except (PrecompileError, OSError) as exc:
        # A check that failed is an answer (exit 1); anything else (a key file that cannot
        # be read, say) is an error (exit 2).
        print(f"precompile: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1 if args.command == "verify" and isinstance(exc, _CHECK_FAILED) else 2


if __name__ == "__main__":
    sys.exit(main())
