"""Which processes a warm GPU load starts (debugging aid for the warm-start benchmark)."""

import os
import subprocess
import sys
import tempfile

CHILD = r"""
import os, sys, time
spawned = []
def audit(event, args):
    if event in ("subprocess.Popen", "os.posix_spawn", "os.exec", "os.system"):
        spawned.append((event, repr(args)[:300]))
sys.addaudithook(audit)
import torch, transformers, precompile
torch.manual_seed(0)
config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
    num_attention_heads=8, num_key_value_heads=4, vocab_size=1000, use_cache=False)
with torch.device("cuda"):
    model = transformers.LlamaForCausalLM(config)
model = model.to(torch.bfloat16).eval()
ids = torch.randint(0, 1000, (1, 64), device="cuda")
with torch.no_grad():
    t = time.perf_counter()
    c = precompile.compile_model(model, (ids,), dynamic={0: [1]}, hints=[16, 256], warmup=False)
    c(ids); torch.cuda.synchronize()
    print("first output", time.perf_counter() - t)
for e in spawned:
    print("SPAWN", e)
"""

if __name__ == "__main__":
    cache = tempfile.mkdtemp()
    shared_triton = tempfile.mkdtemp()
    for label in ("cold", "warm, empty triton cache", "warm, warm triton cache"):
        triton = tempfile.mkdtemp() if label == "cold" else shared_triton
        env = {
            **os.environ,
            "PRECOMPILE_CACHE_DIR": cache,
            "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(),
            "TRITON_CACHE_DIR": triton,
        }
        out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
        print("=====", label, out.returncode)
        print(
            "\n".join(
                line for line in out.stdout.splitlines() if "SPAWN" in line or "first" in line
            )[:6000]
        )
        if out.returncode:
            print(out.stderr[-2000:])
