"""Code that counts what a fresh process does, prepended to the scripts of warm-start
checks (a warm start must start no process, compile nothing and trace no frame)."""

# Counts every process this interpreter starts (gcc, the ISA probe, compile workers...).
AUDIT = """
import os, sys
spawned = []
def _audit(event, args):
    if event in ("subprocess.Popen", "os.posix_spawn", "os.exec", "os.system", "os.fork"):
        spawned.append(event + " " + repr(args)[:160])
sys.addaudithook(_audit)
"""

# Counts inductor compiles and Dynamo frames (a warm start must have none of either).
COUNTED = """
import functools, threading
import torch._inductor.compile_fx as compile_fx
from torch._dynamo import convert_frame
compiles, frames = [], []
original_compile, original_frame = compile_fx.compile_fx, convert_frame._compile
inside = threading.local()
@functools.wraps(original_compile)  # its signature stays readable (options are checked by it)
def counted_compile(*a, **k):
    # compile_fx calls itself (under config_patches, for instance): one compile counts once
    depth = getattr(inside, "depth", 0)
    if depth == 0:
        compiles.append(1)
    inside.depth = depth + 1
    try:
        return original_compile(*a, **k)
    finally:
        inside.depth = depth
compile_fx.compile_fx = counted_compile
convert_frame._compile = lambda *a, **k: (frames.append(1), original_frame(*a, **k))[1]
"""
