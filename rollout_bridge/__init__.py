"""rollout_bridge: everything that produces trajectories for the spopp_jax learner.

Data flows one way: orchestrator -> engine/env -> trajectories -> learner -> published
weights (see docs/DESIGN.md). ``spopp_jax`` never imports this package.
"""

from spopp_jax import quiet as _quiet

_quiet.install()   # before any transformers import: drop its torch-absent notice
