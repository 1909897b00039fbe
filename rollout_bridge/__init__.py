"""rollout_bridge: everything that produces trajectories for the spopp_jax learner.

Data flows one way: orchestrator -> engine/env -> trajectories -> learner -> published
weights (see docs/DESIGN.md). ``spopp_jax`` never imports this package.
"""
