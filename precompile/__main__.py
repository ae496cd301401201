"""``python -m precompile cache ls|info|verify|prune|clear|stats|explain`` (or ``precompile``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from cache import ArtifactCache, CacheEntry


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _ago(timestamp: float) -> str:
    seconds = max(0.0, time.time() - timestamp)
    for unit, width in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= width:
            return f"{seconds / width:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def _emit(data: Any, as_json: bool, text: str) -> None:
    print(json.dumps(data, indent=2, default=str) if as_json else text)


def _find(store: ArtifactCache, prefix: str) -> CacheEntry:
    matches = [e for e in store.entries() if e.key.startswith(prefix)]
    if len(matches) != 1:
        raise SystemExit(
            f"precompile: key prefix {prefix!r} matches {len(matches)} entries; give more digits"
        )
    return matches[0]


def _cache_command(args: argparse.Namespace) -> int:
    store = ArtifactCache(args.root)
    if args.action == "ls":
        entries = sorted(store.entries(), key=lambda e: e.last_used, reverse=True)
        rows = [f"{'KEY':14} {'SIZE':>9} {'VARIANTS':>8} {'LAST USED':>10}  DEVICE"]
        rows += [
            f"{e.key[:12]:14} {_size(e.size):>9} {e.variants:>8} {_ago(e.last_used):>10}  "
            f"{e.factors.get('device', '?')}"
            for e in entries
        ]
        rows.append(
            f"{len(entries)} entries, {_size(sum(e.size for e in entries))} in {store.root}"
        )
        _emit([dataclasses.asdict(e) for e in entries], args.json, "\n".join(rows))
    elif args.action == "info":
        entry = _find(store, args.key)
        text = "\n".join(
            [
                f"key       {entry.key}",
                f"size      {_size(entry.size)}",
                f"variants  {entry.variants}",
                f"created   {_ago(entry.created)}",
                f"last used {_ago(entry.last_used)}",
                "factors:",
            ]
            + [f"  {name:15} {value}" for name, value in sorted(entry.factors.items())]
        )
        _emit(dataclasses.asdict(entry), args.json, text)
    elif args.action == "verify":
        report = store.verify()
        text = f"checked {report.checked} entries: " + (
            "all intact"
            if report.ok
            else f"{len(report.corrupt)} corrupt, moved to quarantine: "
            + ", ".join(k[:12] for k in report.corrupt)
        )
        _emit(dataclasses.asdict(report), args.json, text)
        return 0 if report.ok else 1
    elif args.action == "prune":
        evicted = store.prune(args.max_size)
        _emit({"evicted": evicted}, args.json, f"evicted {len(evicted)} entries")
    elif args.action == "clear":
        if not args.yes:
            raise SystemExit("precompile: 'cache clear' deletes every entry; add --yes")
        removed = store.clear()
        _emit({"removed": removed}, args.json, f"removed {removed} entries")
    elif args.action == "stats":
        stats = store.stats()
        text = (
            f"{stats.entries} entries, {_size(stats.size)} of {_size(stats.size_limit)}; "
            f"hits {stats.hits}, misses {stats.misses}, evictions {stats.evictions}, "
            f"corrupt {stats.corrupt}"
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
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="precompile", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    cache_parser = commands.add_parser("cache", help="inspect and maintain the artifact cache")
    cache_parser.add_argument(
        "--root", help="cache directory (default: $PRECOMPILE_CACHE_DIR or the user cache dir)"
    )
    actions = cache_parser.add_subparsers(dest="action", required=True)
    for name, text in [
        ("ls", "list entries"),
        ("verify", "check every digest"),
        ("stats", "hit/miss/eviction counts and size"),
        ("tags", "named entries (what servers load by name)"),
    ]:
        actions.add_parser(name, help=text).add_argument("--json", action="store_true")
    info = actions.add_parser("info", help="one entry and its key factors")
    info.add_argument("key", help="a key or unique prefix")
    info.add_argument("--json", action="store_true")
    explain = actions.add_parser("explain", help="which factors differ from the nearest entry")
    explain.add_argument("key", help="a key or unique prefix")
    explain.add_argument("--json", action="store_true")
    prune = actions.add_parser("prune", help="evict LRU entries down to the size limit")
    prune.add_argument("--max-size", type=int, help="bytes (default: the cache's limit)")
    prune.add_argument("--json", action="store_true")
    clear = actions.add_parser("clear", help="delete every entry")
    clear.add_argument("--yes", action="store_true", help="confirm")
    clear.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    return _cache_command(args)


if __name__ == "__main__":
    sys.exit(main())
