"""The report of ``shapes.py``: its table of times and ratios, and its plot."""

from __future__ import annotations

import json
import math
from typing import Any

ROWS = ["eager", "dynamic", "ours", "calibrated", "oracle"]


def summarize(document: dict[str, Any]) -> str:
    from _common import table

    rows = document["rows"]
    oracle = rows.get("oracle", {})
    sizes = sorted({int(m) for row in rows.values() for m in row})
    present = [r for r in ROWS if r in rows]
    lines = [
        table(
            ["M", *[f"{r} ms" for r in present]],
            [[m, *(rows[r].get(str(m), {}).get("ms", "-") for r in present)] for m in sizes],
        )
    ]
    ratio_rows = []
    for row in present:
        timed = {m: v["ms"] for m, v in rows[row].items() if "ms" in v}
        ratios = [timed[m] / oracle[m]["ms"] for m in timed if "ms" in oracle.get(m, {})]
        versus_dynamic = [
            timed[m] / rows["dynamic"][m]["ms"]
            for m in timed
            if "ms" in rows.get("dynamic", {}).get(m, {})
        ]
        if ratios:
            geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
            worst_m = max(
                (m for m in timed if "ms" in oracle.get(m, {})),
                key=lambda m: timed[m] / oracle[m]["ms"],
            )
            ratio_rows.append(
                [
                    row,
                    len(ratios),
                    geomean,
                    max(ratios),
                    worst_m,
                    max(versus_dynamic) if versus_dynamic else "-",
                ]
            )
    lines.append("")
    lines.append(
        table(
            ["row", "sizes", "geomean / oracle", "worst / oracle", "worst at M", "worst / dynamic"],
            ratio_rows,
        )
    )
    return "\n".join(lines)


def plot(path: str) -> None:
    from _common import pyplot

    with open(path, encoding="utf-8") as handle:
        document = json.load(handle)
    plt = pyplot()
    rows, oracle = document["rows"], document["rows"].get("oracle", {})
    if plt is None or not oracle:
        return
    figure, axis = plt.subplots(figsize=(8, 4))
    for row in ROWS:
        if row == "oracle" or row not in rows:
            continue
        sizes = sorted(
            int(m) for m, v in rows[row].items() if "ms" in v and "ms" in oracle.get(m, {})
        )
        axis.plot(
            sizes,
            [rows[row][str(m)]["ms"] / oracle[str(m)]["ms"] for m in sizes],
            marker="o",
            markersize=3,
            label=row,
        )
    axis.axhline(1.0, color="black", linewidth=0.8, label="oracle (static compile per M)")
    axis.axhline(1.05, color="gray", linewidth=0.6, linestyle="--")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("tokens M")
    axis.set_ylabel("time / oracle time")
    env = document["environment"]
    axis.set_title(f"{document['block']} block, bf16, {env['device']} (torch {env['torch']})")
    axis.legend(fontsize=8)
    figure.tight_layout()
    target = path.replace(".json", ".png")
    figure.savefig(target, dpi=110)
    print(f"wrote {target}")
