"""What every benchmark prints with its numbers: the CPU it ran on."""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def measured_peak_flops(n: int = 1024, repeats: int = 10) -> float:
    """fp32 matmul FLOP/s of this process's jax (best of ``repeats`` n x n @ n x n): the
    peak that MFU / matmul utilisation figures divide by, measured in the same run so a
    loaded machine lowers peak and workload alike."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    x = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), jnp.float32)
    matmul = jax.jit(lambda a: a @ a)
    matmul(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best
