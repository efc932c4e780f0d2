"""The quantized linear kernel alone: ms and int8 multiply-adds per second, weights hot.

    python bench/quant_kernel.py [--rows 1,16,64] [--peak 1030]

Random weights in the layouts the Qwen2.5-Coder-1.5B Q4_K_M file packs into (Q4_K gate/up,
Q6_K and Q4_K down, q/k/v in Q4_K, and the Q6_K v read apart where its layer keeps it so), run
by ``quant_linear`` on every thread.
Weights of this size stay in the L3 cache between calls, so the figure is the kernel's
arithmetic rate, not memory's; ``--peak`` (``bench/vnni_peak.cpp`` on this machine) adds the
share of the CPU's VPDPBUSD peak. Each case also prints its error against the dequantized
weight, so a faster variant that computes something else shows.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from infer import kernels
from infer.models.quant import QuantTensor, pack

# name, N, K, bits, group, groups per superblock, Q6_K-like (o = s, M = 32 D)
CASES = (
    ("gate/up Q4_K", 17920, 1536, 4, 32, 8, False),
    ("down Q6_K", 1536, 8960, 6, 16, 16, True),
    ("down Q4_K", 1536, 8960, 4, 32, 8, False),
    ("q/k/v Q4_K", 2048, 1536, 4, 32, 8, False),
    ("v Q6_K", 256, 1536, 6, 16, 16, True),
)


def random_weight(
    n: int, k: int, bits: int, group: int, per: int, q6k: bool = False
) -> QuantTensor:
    supers = k // group // per
    scale = torch.randint(-64 if q6k else 0, 64, (n, k // group), dtype=torch.int8)
    d = (torch.rand(n, supers) * 0.01).half()
    return QuantTensor(
        torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8),
        scale,
        scale.clone() if q6k else torch.randint(0, 64, (n, k // group), dtype=torch.int8),
        d,
        d * 32 if q6k else (torch.rand(n, supers) * 0.01).half(),
        bits,
        group,
        per,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,16,64", help="row counts, comma-separated")
    p.add_argument("--peak", type=float, help="the CPU's VPDPBUSD peak, G multiply-adds/s")
    args = p.parse_args()
    if not kernels.has_quant():
        raise SystemExit("this CPU has no AVX2: quantized weights are dequantized")
    ops = kernels.ops()
    torch.manual_seed(0)
    print("| weight | N x K | rows | ms | G multiply-adds/s | of peak | error |")
    print("|---|---|---|---|---|---|---|")
    for name, n, k, bits, group, per, q6k in CASES:
        w = random_weight(n, k, bits, group, per, q6k)
        packed, dense = pack(w), w.dequantize()
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k).bfloat16()
            out = ops.quant_linear(x, packed, None, True)
            ref = x.float() @ dense.T
            err = ((out - ref).norm() / ref.norm()).item()
            for _ in range(3):
                ops.quant_linear(x, packed, None, True)
            times = []
            for _ in range(max(5, 200 // rows)):
                start = time.perf_counter()
                ops.quant_linear(x, packed, None, True)
                times.append(time.perf_counter() - start)
            ms = statistics.median(times) * 1000
            rate = rows * n * k / ms / 1e6
            share = f"{rate / args.peak:.0%}" if args.peak else "–"
            print(f"| {name} | {n} x {k} | {rows} | {ms:.3f} | {rate:.0f} | {share} | {err:.4f} |")


if __name__ == "__main__":
    main()
