"""Benchmark of the SPO++ math core against NumPy implementations in the same run.

    python benchmarks/core_ops.py [--repeats 20] [--tokens 1000000] [--trajectories 10000]
                                  [--results 100000] [--tasks 10000]

Times jitted JAX functions after a warm-up call (``block_until_ready``), median and min of
several repeats, and a NumPy implementation of the same formulas; prints the hardware,
the versions, the JAX/NumPy time ratio and the effective GB/s (bytes of the inputs read
plus outputs written, once, over the median time).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from spopp_jax import advantages, losses, tracker
from _hardware import cpu_model




def _time(fn, repeats: int) -> tuple[float, float]:
    jax.block_until_ready(fn())  # warm-up (compilation for jitted functions)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


# ---- NumPy references (same formulas, float32 like the JAX code) -------------------------

def np_whiten(a, w):
    total = w.sum(dtype=np.float64)
    mu = np.sum(w * a, dtype=np.float32) / np.float32(total)
    c = a - mu
    var = np.sum(w * c * c, dtype=np.float32) / np.float32(max(total - 1.0, 1.0))
    return c / (np.sqrt(var) + np.float32(1e-8))


def np_whiten_tokens(adv, ids, mask, n_seg):
    valid = ids >= 0
    idv = np.where(valid, ids, n_seg)
    act = valid & mask
    lengths = np.bincount(idv, weights=act, minlength=n_seg + 1)[:n_seg].astype(np.float32)
    seg_adv = np.zeros(n_seg + 1, np.float32)
    seg_adv[idv[act]] = adv[act]  # A_i broadcast: any action token holds it
    whitened = np_whiten(seg_adv[:n_seg], lengths)
    return np.where(valid, np.append(whitened, 0.0).astype(np.float32)[idv], 0.0)


def np_observe(alpha, beta, z_ref, ids, z, rew, n_tasks):
    newest = np.full(n_tasks, -np.inf, np.float32)
    np.maximum.at(newest, ids, z)
    z_new = np.maximum(z_ref, newest)
    w = np.exp(z - z_new[ids])
    succ = np.bincount(ids, weights=w * rew, minlength=n_tasks).astype(np.float32)
    fail = np.bincount(ids, weights=w * (1 - rew), minlength=n_tasks).astype(np.float32)
    keep = np.exp(z_ref - z_new)
    return keep * alpha + succ, keep * beta + fail, z_new


def np_policy_loss_and_grad(logp, old, rollout, adv, mask, low=0.2, high=0.28, c=2.0, cap=2.0):
    lr = np.clip(np.where(mask, logp - old, 0.0), -20, 20)
    r = np.exp(lr)
    s = np.minimum(r * adv, np.clip(r, 1 - low, 1 + high) * adv)
    s = np.where(adv < 0, np.maximum(s, c * adv), s)
    w = np.minimum(np.exp(np.clip(np.where(mask, old - rollout, 0.0), -20, 20)), cap)
    active = (s == r * adv) & mask
    return np.sum(np.where(mask, -w * s, 0.0)), np.where(active, -w * r * adv, 0.0)


def _row(name, t_jax, t_np, nbytes):
    (jm, jmin), (nm, nmin) = t_jax, t_np
    print(
        f"{name:<38} jax {jm * 1e3:9.3f} ms (min {jmin * 1e3:8.3f})  "
        f"numpy {nm * 1e3:9.3f} ms (min {nmin * 1e3:8.3f})  "
        f"numpy/jax {nm / jm:6.2f}x  jax {nbytes / jm / 1e9:6.2f} GB/s  numpy {nbytes / nm / 1e9:6.2f} GB/s"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--tokens", type=int, default=1_000_000)
    p.add_argument("--trajectories", type=int, default=10_000)
    p.add_argument("--results", type=int, default=100_000)
    p.add_argument("--tasks", type=int, default=10_000)
    args = p.parse_args()

    print(f"CPU: {cpu_model()}  logical cores: {os.cpu_count()}  "
          f"affinity: {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else '?'}")
    print(f"JAX devices: {jax.devices()}")
    print(f"python {platform.python_version()}  jax {jax.__version__}  "
          f"jaxlib {jax.lib.__version__ if hasattr(jax.lib, '__version__') else '?'}  numpy {np.__version__}")
    print(f"repeats: {args.repeats} (median shown; after one warm-up call)\n")

    rng = np.random.default_rng(0)
    n_traj = args.trajectories
    # lengths with a long tail, rescaled to sum to ~tokens
    raw = rng.lognormal(0.0, 1.0, n_traj)
    lengths = np.maximum(np.round(raw / raw.sum() * args.tokens * 0.8), 0).astype(np.int32)
    adv = (rng.integers(0, 2, n_traj) - rng.uniform(0, 1, n_traj)).astype(np.float32)

    # --- whiten over trajectories (scalar per trajectory) ---
    a_j, l_j = jnp.asarray(adv), jnp.asarray(lengths)
    f_tok = jax.jit(lambda a, n: advantages.whiten(a, n, "token"))
    t_jax = _time(lambda: f_tok(a_j, l_j), args.repeats)
    t_np = _time(lambda: np_whiten(adv, lengths.astype(np.float32)), args.repeats)
    np.testing.assert_allclose(f_tok(a_j, l_j), np_whiten(adv, lengths.astype(np.float32)), rtol=1e-3, atol=1e-4)
    _row(f"whiten token, {n_traj} traj", t_jax, t_np, n_traj * 12)

    # --- whiten_tokens over a packed stream of ~tokens ---
    # each trajectory: a prompt/observation share (non-action) + its action tokens
    extra = rng.integers(1, 30, n_traj)
    seg_len = lengths + extra
    ids = np.repeat(np.arange(n_traj, dtype=np.int32), seg_len)
    mask = np.concatenate([np.r_[np.zeros(e, bool), np.ones(l, bool)] for e, l in zip(extra, lengths)])
    n_tok = args.tokens
    pad = max(n_tok - ids.size, 0)
    ids = np.r_[ids, -np.ones(pad, np.int32)][:n_tok]
    mask = np.r_[mask, np.zeros(pad, bool)][:n_tok]
    tok_adv = np.where(ids >= 0, adv[np.maximum(ids, 0)], 0.0).astype(np.float32)
    ta, ti, tm = jnp.asarray(tok_adv), jnp.asarray(ids), jnp.asarray(mask)
    f_stream = jax.jit(lambda a, s, m: advantages.whiten_tokens(a, s, m, n_traj, "token"))
    t_jax = _time(lambda: f_stream(ta, ti, tm), args.repeats)
    t_np = _time(lambda: np_whiten_tokens(tok_adv, ids, mask, n_traj), args.repeats)
    np.testing.assert_allclose(f_stream(ta, ti, tm), np_whiten_tokens(tok_adv, ids, mask, n_traj), rtol=1e-3, atol=1e-4)
    _row(f"whiten_tokens, {n_tok} tokens", t_jax, t_np, n_tok * (4 + 4 + 1 + 4))

    # --- policy_loss: value and gradient over [B, T] = tokens ---
    b_rows = 64
    shape = (b_rows, n_tok // b_rows)
    old = rng.uniform(-6, 0, shape).astype(np.float32)
    logp = (old + rng.normal(0, 0.3, shape)).astype(np.float32)
    rollout = (old - rng.normal(0, 0.3, shape)).astype(np.float32)
    padv = rng.normal(0, 1, shape).astype(np.float32)
    pmask = rng.random(shape) < 0.6
    jl = [jnp.asarray(x) for x in (logp, old, rollout, padv, pmask)]
    f_loss = jax.jit(jax.value_and_grad(lambda lp, *r: losses.policy_loss(lp, *r)[0]))
    t_jax = _time(lambda: f_loss(*jl), args.repeats)
    t_np = _time(lambda: np_policy_loss_and_grad(logp, old, rollout, padv, pmask), args.repeats)
    np.testing.assert_allclose(f_loss(*jl)[1], np_policy_loss_and_grad(logp, old, rollout, padv, pmask)[1], rtol=1e-4, atol=1e-6)
    _row(f"policy_loss value+grad, {n_tok} tok", t_jax, t_np, n_tok * (4 * 4 + 1 + 4))

    # --- tracker observe of a batch of results ---
    n_res, n_tasks = args.results, args.tasks
    r_ids = rng.integers(0, n_tasks, n_res).astype(np.int32)
    r_z = np.asarray(tracker.policy_coordinate(rng.integers(90_000, 100_000, n_res)), np.float32)
    r_rew = rng.integers(0, 2, n_res).astype(np.float32)
    state = tracker.init(jnp.full(n_tasks, 4.0), jnp.full(n_tasks, 4.0))
    s_np = [np.full(n_tasks, 4.0, np.float32), np.full(n_tasks, 4.0, np.float32), np.zeros(n_tasks, np.float32)]
    ji, jz, jr = jnp.asarray(r_ids), jnp.asarray(r_z), jnp.asarray(r_rew)
    f_obs = jax.jit(tracker.observe)
    t_jax = _time(lambda: f_obs(state, ji, jz, jr), args.repeats)
    t_np = _time(lambda: np_observe(*s_np, r_ids, r_z, r_rew, n_tasks), args.repeats)
    got = f_obs(state, ji, jz, jr)
    np.testing.assert_allclose(got.alpha, np_observe(*s_np, r_ids, r_z, r_rew, n_tasks)[0], rtol=1e-4, atol=1e-30)  # XLA flushes denormals
    _row(f"tracker.observe, {n_res} results", t_jax, t_np, n_res * 12 + n_tasks * 24)

    # --- SPO receipt-order tracker: sequential scan (NumPy: a Python loop) ---
    rho = np.full(n_res, 0.9, np.float32)
    f_spo = jax.jit(tracker.spo_observe)
    jrho = jnp.asarray(rho)

    def np_spo():
        a, b = s_np[0].copy(), s_np[1].copy()
        for x, r, p_ in zip(r_ids.tolist(), r_rew.tolist(), rho.tolist()):
            a[x] = p_ * a[x] + r
            b[x] = p_ * b[x] + (1 - r)
        return a

    t_jax = _time(lambda: f_spo(state, ji, jr, jrho), max(args.repeats // 4, 1))
    t_np = _time(np_spo, max(args.repeats // 4, 1))
    np.testing.assert_allclose(f_spo(state, ji, jr, jrho).alpha, np_spo(), rtol=1e-4)
    _row(f"tracker.spo_observe, {n_res} seq.", t_jax, t_np, n_res * 12 + n_tasks * 16)


if __name__ == "__main__":
    main()
