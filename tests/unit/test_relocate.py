"""Moving a lean GPU variant's wrapper source to another device index (``to()``): every
place inductor names the device is rewritten, and any other way of naming one refuses."""

from __future__ import annotations

import pytest

from precompile.runtime._relocate import RelocationRefused, relocate_source

# The shape of an H200 variant's wrapper (torch 2.11): module-level launch streams, a
# kernel source string that names its device, a call under the device guard, and the
# benchmark helpers that are never run.
SOURCE = """
import torch
from torch._C import _cuda_getCurrentRawStream as get_raw_stream
empty_strided_cuda = torch._C._dynamo.guards._empty_strided_cuda
async_compile = AsyncCompile()
AUTOTUNE = '''
buf1 = generate_example_value((8, 128), (128, 1), 'cuda:5', torch.float32, 0, (8, 128))
'''
triton_poi__0 = async_compile.triton('triton_poi__0', '''
@triton_heuristics.pointwise(
    triton_meta={'device': DeviceProperties(type='cuda', index=0, cc=90), 'x': 'cuda:3'},
)
''', device_str='cuda')

def call(args):
    arg0_1, = args
    with torch.cuda._DeviceGuard(0):
        torch.cuda.set_device(0)
        buf0 = empty_strided_cuda((8, ), (1, ), torch.float32)
        stream0 = get_raw_stream(0)
        triton_poi__0.run(arg0_1, buf0, 8, stream=stream0)
        ones = torch.ones(3, device=device(type='cuda', index=0))
        other = torch.zeros(2, device='cuda:0')
    return (buf0, ones, other)

def get_args():
    return [rand_strided((8, ), (1, ), device='cuda:0', dtype=torch.float32)]
"""


def test_every_device_index_inductor_writes_is_moved() -> None:
    moved = relocate_source(SOURCE, 0, 1)
    assert "torch.cuda._DeviceGuard(1)" in moved
    assert "torch.cuda.set_device(1)" in moved
    assert moved.count("get_raw_stream(1)") == 1
    assert "device(type='cuda', index=1)" in moved
    assert moved.count("'cuda:1'") == 2
    for old in ("_DeviceGuard(0)", "set_device(0)", "get_raw_stream(0)", "index=0)", "'cuda:0'"):
        assert old not in moved.replace("index=0, cc=90", ""), old
    # the kernel source string is never compiled on the lean path: left as it was
    assert "DeviceProperties(type='cuda', index=0, cc=90), 'x': 'cuda:3'" in moved
    # the rest of the text is untouched
    assert moved.replace("1)", "0)").replace("'cuda:1'", "'cuda:0'") == SOURCE.replace("1)", "0)")
    assert relocate_source(moved, 1, 0) == SOURCE


@pytest.mark.parametrize(
    "line, why",
    [
        ("torch.cuda.synchronize()", "torch.cuda.synchronize"),
        ("x = arg0_1.to(1)", ".to(<index>)"),
        ("x = torch.empty(3, device=1)", "an integer"),
        ("x = torch.empty(3, device=torch.device('cuda', 2))", "names device 2"),
        ("x = torch.empty(3, device='cuda:2')", "'cuda:2'"),
        ("stream1 = get_raw_stream(1)", "names device 1"),
        ("stream1 = get_raw_stream(arg0_1)", "not a literal index"),
        ("stream1 = get_raw_stream(0, 1)", "other arguments"),
        ("x = device(type=kind, index=0)", "device type not read here"),
    ],
)
def test_any_other_way_of_naming_a_device_refuses_the_move(line: str, why: str) -> None:
    source = SOURCE.replace("    return (buf0, ones, other)", f"    {line}\n    return buf0")
    with pytest.raises(RelocationRefused, match=why.replace("(", r"\(").replace(")", r"\)")):
        relocate_source(source, 0, 1)
