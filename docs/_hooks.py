"""mkdocs hooks. The benchmark plots live with their JSON in ``benchmarks/results/``, and
the pages link them there (which GitHub renders); the site copies them in as
``results/`` and points those links at the copies, so that the built pages show them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def on_files(files: Files, config: Any) -> Files:
    for plot in sorted(RESULTS.glob("*.png")):
        files.append(
            File(
                f"results/{plot.name}",
                src_dir=str(RESULTS.parent),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files


def on_page_markdown(markdown: str, **_: Any) -> str:
    return markdown.replace("](../benchmarks/results/", "](results/")
