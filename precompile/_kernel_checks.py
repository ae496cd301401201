"""A compiled C++ kernel's failed index check raises; it never ends the process.

Inductor's CPU kernels check indirect indices (``TORCH_CHECK(tmp15 < ks2, "index out of
bounds: ...")``), and most of those checks run inside ``#pragma omp parallel``: an
exception that leaves an OpenMP region calls ``std::terminate`` (SIGABRT, exit 134).
Torch itself records integer division by zero inside the region in a flag and raises
after it; this does the same for every exception of a kernel's loop bodies:

- each iteration of a worksharing loop (``#pragma omp for``, innermost collapsed level)
  runs inside ``try``; a throw there leaves that iteration only, before the access its
  check guards, and the first message is kept;
- the parallel region's own body is wrapped likewise (a check outside any loop);
- after the region (at the end of the kernel, on the calling thread) the kept message is
  thrown: a ``RuntimeError`` to Python, which the runtime names (``IndexOutOfRangeError``).

The rewrite is of the kernel's source, when inductor generates it (so the binary an
artifact bundles is the rewritten one); a kernel without a check in a parallel region is
left as it is. A failed check's thread skips the rest of that iteration, other threads
finish theirs: a graph that writes an input (a KV cache) may have written part of it.
"""

from __future__ import annotations

import re

MARK = "precompile: index checks raise"
_FOR = re.compile(r"^\s*#pragma omp for\b(?:.*\bcollapse\((\d+)\))?")
_PARALLEL = re.compile(r"^\s*#pragma omp parallel\b")
_CATCH = (
    "}} catch (const std::exception& precompile_exc) {{ {record}(precompile_exc.what()); }} "
    'catch (...) {{ {record}("unknown exception"); }}'
)
_PRELUDE = """\
// {mark}
#include <mutex>
#include <string>
namespace {{
struct PrecompileKernelError {{
    std::mutex lock;
    std::string what;
    void note(const char* message) {{
        std::lock_guard<std::mutex> guard(lock);
        if (what.empty()) what = message;
    }}
}};
}}  // namespace
"""


class _Unparsed(Exception):
    pass


def _block_end(lines: list[str], open_at: int) -> int:
    """The line closing the ``{`` that stands alone on line ``open_at``."""
    depth = 0
    for number in range(open_at, len(lines)):
        text = lines[number].split("//", 1)[0]
        text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)  # braces in strings count not
        depth += text.count("{") - text.count("}")
        if depth == 0:
            return number
    raise _Unparsed("unbalanced braces")


def _body_open(lines: list[str], header: int) -> int:
    """The line of the ``{`` opening the statement after ``header`` (a pragma or for)."""
    number = header + 1
    if number < len(lines) and lines[number].strip() == "{":
        return number
    raise _Unparsed(f"no block after line {header + 1}: {lines[header].strip()!r}")


def _loop_body(lines: list[str], pragma: int, levels: int) -> int:
    """The ``{`` of the innermost of ``levels`` collapsed for loops after ``pragma``."""
    at = pragma
    for _ in range(levels):
        at += 1
        while at < len(lines) and lines[at].strip().startswith("#pragma"):
            at += 1
        if at >= len(lines) or not lines[at].strip().startswith("for("):
            raise _Unparsed(f"no for loop after line {pragma + 1}")
        at = _body_open(lines, at)
    return at


def raise_index_checks(source: str) -> str:
    """``source`` (one kernel's C++) with its failed checks raised after the parallel
    region instead of ending the process; unchanged where it has no check in a parallel
    region. Raises ``ValueError`` where its layout is not the one inductor writes."""
    if "TORCH_CHECK(" not in source or "#pragma omp parallel" not in source or MARK in source:
        return source
    lines = source.split("\n")
    try:
        wraps: list[tuple[int, int]] = []  # (line of "{", line of its "}")
        for number, line in enumerate(lines):
            loop = _FOR.match(line)
            if loop:
                opened = _loop_body(lines, number, int(loop.group(1) or 1))
                wraps.append((opened, _block_end(lines, opened)))
            elif _PARALLEL.match(line):
                opened = _body_open(lines, number)
                wraps.append((opened, _block_end(lines, opened)))
        heads = [n for n, line in enumerate(lines) if line.startswith('extern "C"')]
        if len(heads) != 1:
            raise _Unparsed(f'{len(heads)} extern "C" functions')
        body = next(n for n in range(heads[0], len(lines)) if lines[n] == "{")
        end = _block_end(lines, body)
    except (_Unparsed, StopIteration) as exc:
        raise ValueError(f"cannot make this kernel's checks raise: {exc}") from None
    record = "precompile_error.note"
    inserts: dict[int, list[str]] = {}  # line -> text to put after it
    befores: dict[int, list[str]] = {}  # line -> text to put before it
    for opened, closed in wraps:
        inserts.setdefault(opened, []).append("try {")
        befores.setdefault(closed, []).insert(0, _CATCH.format(record=record))
    inserts.setdefault(body, []).insert(0, "PrecompileKernelError precompile_error;")
    befores.setdefault(end, []).append(
        "if (!precompile_error.what.empty()) { TORCH_CHECK(false, precompile_error.what); }"
    )
    out: list[str] = []
    for number, line in enumerate(lines):
        out.extend(befores.get(number, []))
        out.append(line)
        out.extend(inserts.get(number, []))
    text = "\n".join(out)
    include = "#include <torch/csrc/inductor/cpp_prefix.h>"
    if include not in text:
        raise ValueError("cannot make this kernel's checks raise: no cpp_prefix.h include")
    return text.replace(include, include + "\n" + _PRELUDE.format(mark=MARK), 1)
