"""GPU smoke test of the native backend's wgmma decode variant before a long benchmark run: build,
then native decode variant 4 == the prefill path's rows (M = 1, 8, 16; N = K = 2048, K segments).
Prints WGMMA_OK on success; a crash or hang here leaves the benchmark to run without it."""

from __future__ import annotations

import torch

from mismatch_probe.kernels import nvfp4_quantize_ref
from mismatch_probe.kernels.nvfp4 import native
from mismatch_probe.kernels.nvfp4 import tc_linear as T

print("native:", native.available(), native.status(), flush=True)
g = torch.Generator(device="cuda").manual_seed(5)
tw = T.prepare(nvfp4_quantize_ref(torch.randn(2048, 2048, device="cuda", generator=g, dtype=torch.bfloat16)))
aq = nvfp4_quantize_ref(torch.randn(16, 2048, device="cuda", generator=g, dtype=torch.bfloat16), per_token=True)
full = T.tc_matmul(aq, tw, path="prefill")
native.NATIVE_CFG["variant"] = 4
ok = True
for m in (1, 8, 16):
    sub = type(aq)(aq.codes[:m], aq.scales[:m], aq.amax[:m], True)
    y = T.tc_matmul(sub, tw, path="decode")
    torch.cuda.synchronize()
    same = torch.equal(y.view(torch.int16), full[:m].view(torch.int16))
    print(f"M={m} record {native.decode_variant(m, tw)} rows == prefill: {same}", flush=True)
    ok &= same
print("WGMMA_OK" if ok else "WGMMA_MISMATCH", flush=True)
