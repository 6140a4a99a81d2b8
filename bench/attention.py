#!/usr/bin/env python3
"""bench/attention.py — torch's scaled_dot_product_attention on the shapes of bench/attention.cu.

Causal, bf16, q/k head 192 and v head 128 (the flash backend refuses those; cuDNN takes them).
Tensors are laid out as moetrain's kernels read them: token-major [B, T, H, d], handed to SDPA
as [B, H, T, d] views. FLOPs are counted as bench/attention.cu counts them: the causal half,
2 * B * H * (T*T/2) * (dq + dv) for the forward and 2.5 times that for the backward. Each timing
is the median of 10 runs after 3 warm-up runs, CUDA events around one call.

    python3 bench/attention.py [--backend cudnn|flash|efficient|math]

Prints one "torch-timing ..." line per shape, in the format of the C bench's "timing" lines.
"""
import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [(8, 2048, 16, 192, 128), (2, 4096, 16, 192, 128)]
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def median_ms(fn, warmup=3, iters=10):
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for it in range(warmup + iters):
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        if it >= warmup:
            times.append(e0.elapsed_time(e1))
    times.sort()
    return 0.5 * (times[iters // 2 - 1] + times[iters // 2])


def bench(B, T, H, dq, dv, backend):
    g = torch.Generator(device="cuda").manual_seed(1)
    def rnd(d):
        return torch.randn(B, T, H, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    q, k, v = (rnd(dq).requires_grad_(), rnd(dq).requires_grad_(), rnd(dv).requires_grad_())
    do = rnd(dv)
    scale = dq ** -0.5
    with sdpa_kernel([backend]):
        fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        t_fwd = median_ms(fwd)
        out = fwd()
        bwd = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        t_bwd = median_ms(bwd)
    flops_fwd = 2.0 * B * H * (T * T / 2.0) * (dq + dv)
    flops_bwd = 2.5 * flops_fwd
    return t_fwd, flops_fwd / (t_fwd * 1e-3) / 1e12, t_bwd, flops_bwd / (t_bwd * 1e-3) / 1e12


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cudnn", choices=sorted(BACKENDS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("torch-attention: no CUDA device", file=sys.stderr)
        return 1
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}, "
          f"SDPA backend {args.backend}")
    rc = 0
    for B, T, H, dq, dv in SHAPES:
        try:
            f_ms, f_tf, b_ms, b_tf = bench(B, T, H, dq, dv, BACKENDS[args.backend])
        except RuntimeError as e:   # the backend refuses the shape
            print(f"torch-timing B={B} T={T} H={H} dq={dq} dv={dv}: {args.backend} failed: {str(e).splitlines()[0]}")
            rc = 1
            continue
        print(f"torch-timing B={B} T={T} H={H} dq={dq} dv={dv}: forward {f_ms:.3f} ms ({f_tf:.1f} TFLOP/s), "
              f"backward {b_ms:.3f} ms ({b_tf:.1f} TFLOP/s)")
        torch.cuda.empty_cache()
    return rc


if __name__ == "__main__":
    sys.exit(main())
