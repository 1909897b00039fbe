"""spopp_jax: the SPO++ learner in JAX (pure functions over pytrees).

Submodules are imported on demand (``from spopp_jax import tracker``); this package
``__init__`` stays light on purpose.
"""

__version__ = "0.1.0"
