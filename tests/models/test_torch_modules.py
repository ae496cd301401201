"""torch.nn's own modules and a ResNet-like conv net are whole models like any other
(issue 49): each row of the table in docs/whole-models.md ("Model kinds") is compiled
once per session, answers equal to eager across sizes (1 included, traced apart), is
found again in a fresh process with no Dynamo frame, inductor compile or compiler
process, and keeps the checks of what its trace read.

Before, every module of torch.nn was refused: Dynamo traces them from its own wrapper
frame around the module (``external_utils.wrap_inline``), which was taken for another
function than the model's forward. torchvision is not installed here: the ResNet row is
a hand-written net of torchvision's BasicBlock shape (torchvision's own ResNet-18 is
tests/gpu/test_gpu.py's, where torchvision is installed)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock: two 3x3 convs with batch norm, and a 1x1
    downsample on the identity where the shape changes."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or inputs != outputs:
            self.downsample = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class TinyResNet(nn.Module):
    """A ResNet of torchvision's layout (stem, layers of BasicBlocks, pool, fc), tiny."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(8, 8, 1))
        self.layer2 = nn.Sequential(BasicBlock(8, 16, 2))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.relu(self.bn1(self.conv1(x)))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _resnet() -> nn.Module:
    model = TinyResNet().eval()
    with torch.no_grad():  # batch norm statistics of a trained net, not the identity
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    return model


@dataclass(frozen=True)
class Row:
    """A model kind: how to build it, an input at a given size of its dynamic dim, the
    dims declared dynamic (``compile_model``'s ``dynamic=``), the sizes it is served at,
    and sizes it is refused at, with the reason's words."""

    build: Callable[[], nn.Module]
    make: Callable[[int], torch.Tensor]
    example: int
    dynamic: dict[int | str, list[int]]
    served: tuple[int, ...]
    refused: tuple[int, ...] = ()
    refused_because: str = ""


ROWS: dict[str, Row] = {
    "torch.nn.Linear": Row(
        lambda: nn.Linear(8, 8), lambda n: torch.randn(n, 8), 4, {0: [0]}, (1, 2, 7, 33)
    ),
    "torch.nn.Sequential": Row(
        lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)),
        lambda n: torch.randn(n, 8),
        4,
        {0: [0]},
        (1, 3, 9, 33),
    ),
    "torch.nn.TransformerEncoderLayer": Row(
        lambda: nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval(),
        lambda n: torch.randn(2, n, 16),
        5,
        {0: [1]},
        (1, 2, 9, 40),
    ),
    "ResNet-like conv net": Row(
        _resnet,
        lambda n: torch.randn(n, 3, 16, 16),
        4,
        {0: [0]},
        (1, 2, 5, 15),
        refused=(16,),
        refused_because=r"guards fail: s\d+ <= 15",
    ),
}


def build(name: str) -> tuple[nn.Module, torch.Tensor]:
    """The row's model and example, the same in every process."""
    row = ROWS[name]
    torch.manual_seed(0)
    return row.build(), row.make(row.example)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("torch-modules-cache"))


_compiled: dict[str, tuple[nn.Module, Any]] = {}


def compiled(name: str, store: str) -> tuple[nn.Module, Any]:
    """Each row compiled once per session."""
    import precompile

    if name not in _compiled:
        model, example = build(name)
        with torch.no_grad():
            _compiled[name] = (
                model,
                precompile.compile_model(
                    model, (example,), dynamic=ROWS[name].dynamic, cache=store, warmup=False
                ),
            )
    return _compiled[name]


@pytest.mark.parametrize("name", list(ROWS))
def test_each_row_is_served_equal_to_eager(name: str, store: str) -> None:
    import precompile

    model, served = compiled(name, store)
    row = ROWS[name]
    torch.manual_seed(1)
    with torch.no_grad():
        for size in row.served:
            x = row.make(size)
            torch.testing.assert_close(served(x), model(x), rtol=1e-5, atol=1e-5)
        for size in row.refused:
            with pytest.raises(precompile.NoVariantError, match=row.refused_because):
                served(row.make(size))
    assert served.plan.trace_read.unchecked == ()  # every guard of the trace is a check


WARM = """
import sys, torch, precompile
sys.path[:0] = ["tests", "tests/models"]
from test_torch_modules import ROWS, build
{counted}
for name, row in ROWS.items():
    model, example = build(name)
    torch.manual_seed(1)
    with torch.no_grad():
        served = precompile.compile_model(model, (example,), dynamic=row.dynamic,
                                          cache={store!r}, compile=False)
        worst = max((served(x) - model(x)).abs().max().item()
                    for x in (row.make(size) for size in row.served))
    assert served.wait_warm(timeout=120)
    print(name, "worst", worst)
print("frames", len(frames), "compiles", len(compiles), "spawned", len(spawned), spawned)
"""


def test_every_row_warm_starts_in_a_fresh_process(store: str) -> None:
    from conftest import run_python
    from warm_start_helpers import AUDIT, COUNTED

    for name in ROWS:
        compiled(name, store)
    out = run_python(AUDIT + WARM.format(counted=COUNTED, store=store))
    assert "frames 0 compiles 0 spawned 0 []" in out, out
    worst = {line.split(" worst ")[0]: float(line.split(" worst ")[1])
             for line in out.splitlines() if " worst " in line}  # fmt: skip
    assert set(worst) == set(ROWS) and max(worst.values()) < 1e-5, out


def test_guards_of_a_torch_nn_module_are_checked(store: str) -> None:
    """What the trace of a torch.nn module read is checked as for any model: its mode per
    call, a submodule replaced at the next call, an attribute at ``check_model``."""
    import precompile

    model, served = compiled("torch.nn.TransformerEncoderLayer", store)
    x = ROWS["torch.nn.TransformerEncoderLayer"].make(3)
    with torch.no_grad():
        model.train()
        try:
            with pytest.raises(precompile.InputMismatchError, match="train"):
                served(x)
        finally:
            model.eval()
        model.norm_first = True
        try:
            with pytest.raises(precompile.IncompatibleArtifactError, match="norm_first"):
                served.check_model()
        finally:
            model.norm_first = False
        linear2 = model.linear2
        model.linear2 = nn.Identity()  # type: ignore[assignment]
        try:
            with pytest.raises(precompile.IncompatibleArtifactError, match="linear2"):
                served(x)
        finally:
            model.linear2 = linear2
        torch.testing.assert_close(served(x), model(x), rtol=1e-5, atol=1e-5)


def test_the_docs_table_holds_every_row() -> None:
    """docs/whole-models.md's table of model kinds lists each row as served here."""
    page = (ROOT / "docs" / "whole-models.md").read_text()
    table = page.split("## Model kinds", 1)[1].split("\n\n|", 1)[1].split("\n\n", 1)[0]
    for name in ROWS:
        (line,) = [line for line in table.splitlines() if line.startswith(f"| `{name}`")
                   or line.startswith(f"| {name}")]  # fmt: skip
        assert "served" in line and "test_torch_modules.py" in line, line
    assert re.search(r"torchvision's own ResNet-18.*served.*tests/gpu/test_gpu\.py", table), table
