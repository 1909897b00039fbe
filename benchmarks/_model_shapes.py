"""Named Qwen3 shapes the benchmarks share (transformers config names).

"M": vocab 512, hidden 256, 4 layers, 8 / 2 heads x 32, ffn 768 (3.15M matmul params);
"10m": vocab 2048, hidden 384, 5 layers, 6 / 2 heads x 64, ffn 1024 (~10M params);
"job": the main job's tiny policy (configs/default.yaml): vocab 1024, hidden 128, 2 layers,
4 / 2 heads x 32, ffn 384.
"""

from __future__ import annotations

MODEL_SHAPES = {
    "10m": dict(vocab_size=2048, hidden_size=384, intermediate_size=1024, num_hidden_layers=5,
                num_attention_heads=6, num_key_value_heads=2, head_dim=64),
    "M": dict(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=2, head_dim=32),
    "job": dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}

# command-line flag -> transformers config name (benchmarks/learner_step.py, learner_ab.py)
SHAPE_FLAGS = {"vocab": "vocab_size", "hidden": "hidden_size", "ffn": "intermediate_size",
               "layers": "num_hidden_layers", "heads": "num_attention_heads",
               "kv_heads": "num_key_value_heads", "head_dim": "head_dim"}


def add_shape_arguments(parser) -> None:
    """--model NAME plus one flag per dimension (a given flag overrides the model's)."""
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), default="M",
                        help="named shape (benchmarks/_model_shapes.py); default M")
    for flag in SHAPE_FLAGS:
        parser.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None)


def resolve_shape(args) -> None:
    """Fill the dimension flags left unset from ``args.model``'s shape, in place."""
    shape = MODEL_SHAPES[args.model]
    for flag, name in SHAPE_FLAGS.items():
        if getattr(args, flag) is None:
            setattr(args, flag, shape[name])


def add_job_batch_arguments(parser, batches: int) -> None:
    """The arguments of the learner benchmarks on main-job batches (packed_batches.py,
    action_head.py): the job's policy shape (``--model job``, flags override), trajectories
    per batch and their lengths, ``batches`` batches per round, the job's padding and K,
    and the interleaved-rounds protocol (benchmarks/_protocol.py)."""
    import os

    add_shape_arguments(parser)
    parser.set_defaults(model="job")
    parser.add_argument("--batch", type=int, default=16, help="trajectories per update")
    parser.add_argument("--lengths", type=int, nargs=2, default=[400, 1600],
                        help="trajectory lengths, uniform in [lo, hi] (the main job: mean ~930, "
                             "longest of a batch ~1,400)")
    parser.add_argument("--batches", type=int, default=batches, help="batches per round")
    parser.add_argument("--pad-to-multiple", type=int, default=256)
    parser.add_argument("--mini-batches", type=int, default=4, help="PPO mini-batches K")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-load-excess", type=float, default=0.5)
    parser.add_argument("--allow-busy", action="store_true")
    parser.add_argument("--seed", type=int, default=0)


def job_batch_header(args) -> str:
    """The first line of a main-job batch benchmark's output: the CPU, the load, the threads,
    the jax version, the model and the batches (`add_job_batch_arguments`)."""
    import os

    import jax
    from _hardware import cpu_model

    load = os.getloadavg()
    return (f"hardware: {cpu_model()}, {os.cpu_count()} cpus, load avg {load[0]:.1f}/{load[1]:.1f}/"
            f"{load[2]:.1f}; {args.threads} threads; jax {jax.__version__}; model: hidden "
            f"{args.hidden} x {args.layers} layers, vocab {args.vocab}; K = {args.mini_batches}; "
            f"{args.batches} batches of {args.batch} trajectories, lengths U[{args.lengths[0]}, "
            f"{args.lengths[1]}]")
