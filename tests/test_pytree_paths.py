"""The one pytree path-naming helper (learner, checkpoint, partitioning)."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from spopp_jax.pytree_paths import path_name, path_parts


class Pair(NamedTuple):
    first: object
    second: object


def test_dict_attribute_and_index_entries_spell_the_same():
    tree = {"params": Pair(first=[jnp.zeros(1), {"kernel": jnp.ones(2)}], second=jnp.zeros(3))}
    names = [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert names == ["params.first.0", "params.first.1.kernel", "params.second"]
    flat = jax.tree_util.tree_flatten_with_path({"params": {"first": {"0": 1, "1": {"kernel": 2}}, "second": 3}})[0]
    assert [path_name(p) for p, _ in flat] == ["params.first.0", "params.first.1.kernel", "params.second"]


def test_an_nnx_variable_value_is_not_part_of_the_name():
    class Tiny(nnx.Module):
        def __init__(self):
            self.proj = nnx.Linear(2, 3, rngs=nnx.Rngs(0))

    state = nnx.state(Tiny(), nnx.Param)
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    assert sorted(path_name(p, strip_value=True) for p in paths) == ["proj.bias", "proj.kernel"]
    assert all(path_parts(p, strip_value=True)[-1] in ("bias", "kernel") for p in paths)
    assert path_parts([jax.tree_util.DictKey("value")]) == ("value",)  # kept unless asked
