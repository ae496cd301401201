"""Every ``python`` block of the README and of ``docs/`` runs as written.

A page's blocks run in order in one fresh process, as a reader goes down the page (a
block may use what an earlier block of its page made). Where a block needs what the
reader already has, its page says so in words and a marker line right before the block,
``<!-- after: NAME -->``, names the prelude run first (one of ``PRELUDES``); nothing else
is added to what the page shows.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- after: (?P<name>[^>]+?) -->$")
FENCE = "```"


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    code: str
    prelude: str | None


def blocks(page: Path) -> list[Block]:
    """The page's ``python`` blocks, each with the prelude its marker names."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        if lines[index].strip() == FENCE + "python":
            end = index + 1
            while not lines[end].strip().startswith(FENCE):  # a block in a list is indented
                end += 1
            marker = None
            before = index - 1
            while before >= 0 and not lines[before].strip():
                before -= 1
            match = MARKER.match(lines[before].strip()) if before >= 0 else None
            if match:
                marker = match.group("name")
            code = textwrap.dedent("\n".join(lines[index + 1 : end]))
            found.append(Block(page, index + 1, code, marker))
            index = end
        index += 1
    return found


def _quickstart() -> str:
    (block,) = blocks(ROOT / "README.md")
    return block.code


TINY_LLAMA = """
import torch, precompile
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
)).eval()
vocab = model.config.vocab_size
ids = prompt = torch.randint(0, vocab, (2, 8))
"""

ONE_RANK = (
    TINY_LLAMA
    + """
import os, socket
import torch.distributed as dist

# what torchrun gives a rank, for a world of one process
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
shard = model
"""
)

PRELUDES = {
    "the Quickstart": _quickstart(),
    "a tiny Llama": TINY_LLAMA,
    "one rank": ONE_RANK,
}


def page_program(page: Path) -> str:
    """The page's blocks in order, each prelude once, before the first block naming it."""
    parts: list[str] = []
    run: set[str] = set()
    for block in blocks(page):
        if block.prelude and block.prelude not in run:
            parts.append(PRELUDES[block.prelude])
            run.add(block.prelude)
        parts.append(f"# {block.page.name}:{block.line}\n{block.code}")
    return "\n\n".join(parts)


RUNNABLE = [page for page in PAGES if blocks(page)]


def test_every_marker_names_a_prelude_and_precedes_a_block() -> None:
    """A typo in a marker would leave its block without what it needs, or a marker
    without a block: both are errors here, not silent skips."""
    assert len(RUNNABLE) >= 5, RUNNABLE
    for page in PAGES:
        marked = [n for n, t in enumerate(page.read_text().splitlines(), 1) if "<!-- after:" in t]
        used = {b.line for b in blocks(page) if b.prelude}
        assert len(marked) == len(used), (page.name, marked, sorted(used))
        for block in blocks(page):
            assert block.prelude is None or block.prelude in PRELUDES, (page.name, block)


@pytest.mark.parametrize("page", RUNNABLE, ids=[p.name for p in RUNNABLE])
def test_page_code_runs_as_written(
    page: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    base = tmp_path_factory.getbasetemp()
    shared = base / "docs-cache"  # pages share their compiles
    # and the kernels those compiles built, through the run's one build dir (conftest;
    # decode.md: 111 -> 65 s on 2 cores when the pages first shared one)
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PRECOMPILE_CACHE_DIR": str(shared), "PYTHONPATH": path}
    result = subprocess.run(
        [sys.executable, "-c", page_program(page)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, f"{page.name}:\n{result.stdout}\n{result.stderr[-6000:]}"


LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def test_every_relative_link_resolves() -> None:
    """Links between pages, to the README, CHANGELOG and benchmark plots point at files
    that exist (the site build leaves links out of ``docs/`` to this test)."""
    broken = []
    for page in [*PAGES, ROOT / "CHANGELOG.md"]:
        for match in LINK.finditer(page.read_text()):
            target = match.group("target").split("#")[0]
            if not target or "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


@pytest.mark.subprocess
def test_the_docs_site_builds_strict(tmp_path: Path) -> None:
    """``mkdocs build --strict``: every page in the nav, every link and anchor, the
    benchmark plots, and the API reference generated from the docstrings (a name it
    cannot find fails the build)."""
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings_handlers.python", reason="pip install -e '.[docs]'")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    decode = (tmp_path / "site" / "decode" / "index.html").read_text()
    assert 'src="../results/decode-llama-h200.png"' in decode  # plots copied in (docs/_hooks.py)
    assert (tmp_path / "site" / "results" / "decode-llama-h200.png").is_file()
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    for name in ("standalone_compile", "CompiledArtifact", "ArtifactCache", "NoVariantError"):
        assert f'id="precompile.{name}"' in reference, name
