"""The MoE dispatch with experts split over `expert` and assignments exchanged by all-to-all
(model.moe.exchange=all_to_all): output and gradients equal one device's `dispatch` for every
split of the experts, beside data, fsdp and tensor, and for routing that sends every token to
one device's experts (dropless)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlmjax import config as config_lib
from dlmjax.model import moe
from dlmjax.parallel import rules

B, L, D, E, K, F = 8, 4, 16, 8, 2, 16


def _mesh(**axes):
  shape = tuple(axes.get(a, 1) for a in config_lib.MESH_AXES)
  devices = np.asarray(jax.devices()[: int(np.prod(shape))]).reshape(shape)
  return jax.sharding.Mesh(devices, config_lib.MESH_AXES)


def _inputs(unbalanced=False):
  keys = jax.random.split(jax.random.key(0), 6)
  x = jax.random.normal(keys[0], (B, L, D))
  if unbalanced:  # every token to the last two experts: one device receives every assignment
    experts = jnp.broadcast_to(jnp.array([E - 1, E - 2], jnp.int32), (B, L, K))
  else:
    experts = jax.lax.top_k(jax.random.normal(keys[1], (B, L, E)), K)[1]
  weights = jax.nn.softmax(jax.random.normal(keys[2], (B, L, K)), -1)
  gate, up = (0.3 * jax.random.normal(k, (E, D, F)) for k in keys[3:5])
  down = 0.3 * jax.random.normal(keys[5], (E, F, D))
  return x, experts, weights, gate, up, down


def _loss(fn):
  """sum(sin(out)) and its gradients w.r.t. x, the routing weights and the experts."""

  def loss(x, experts, weights, gate, up, down):
    out = fn(x, experts, weights, gate, up, down)
    return jnp.sum(jnp.sin(out)), out

  grad = jax.value_and_grad(loss, argnums=(0, 2, 3, 4, 5), has_aux=True)
  return jax.jit(lambda *a: (lambda r: (r[0][1], r[1]))(grad(*a)))


def _reference(x, experts, weights, gate, up, down):
  out = moe.dispatch(
    x.reshape(B * L, D), experts.reshape(B * L, K), weights.reshape(B * L, K), gate, up, down
  )
  return out.reshape(B, L, D)


def _sharded(mesh, exchange, args):
  stream = rules.spec((rules.BATCH, rules.LENGTH, rules.ACT_EMBED))
  wide, narrow = P('expert', None, 'tensor'), P('expert', 'tensor', None)
  specs = (stream, stream, stream, wide, wide, narrow)
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]

  def fn(*a):
    with rules.activation_mesh(mesh):
      return moe._sharded_dispatch(*a, backend='xla', exchange=exchange)

  return _loss(fn)(*args)


@pytest.fixture(scope='module')
def reference():
  return {u: _loss(_reference)(*_inputs(u)) for u in (False, True)}


@pytest.mark.parametrize(
  'axes',
  [
    dict(expert=2),
    dict(expert=4),
    dict(expert=8),  # one expert a device
    dict(data=2, expert=2, tensor=2),
    dict(fsdp=2, expert=4),
    dict(expert=2, context=2, tensor=2),
  ],
  ids=lambda a: 'x'.join(f'{k}{v}' for k, v in a.items()),
)
@pytest.mark.parametrize('unbalanced', [False, True], ids=['routed', 'one_device'])
def test_all_to_all_matches_one_device_forward_and_gradient(reference, axes, unbalanced):
  want, g_want = reference[unbalanced]
  got, g_got = _sharded(_mesh(**axes), 'all_to_all', _inputs(unbalanced))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for name, a, b in zip(('x', 'weights', 'gate', 'up', 'down'), g_got, g_want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize(
  'exchange,axes',
  [('gather', dict(data=2, expert=2, tensor=2)), ('all_to_all', dict(fsdp=2, expert=4))],
)
def test_stacked_experts_read_at_a_layer_match_one_device(reference, exchange, axes):
  """The inference layout's experts (ModelConfig.experts_in_place): stacks [layers, E, ...] split
  behind their layers axis, read at a traced layer; layer 1 holds the reference's experts and
  layer 0 others, so reading the wrong layer misses. Forward only, as inference runs it."""
  mesh = _mesh(**axes)
  x, experts, weights, *w = _inputs()
  stacks = [jnp.stack([-2.0 * a, a]) for a in w]
  stream = rules.spec((rules.BATCH, rules.LENGTH, rules.ACT_EMBED))
  wide, narrow = P(None, 'expert', None, 'tensor'), P(None, 'expert', 'tensor', None)
  args = [
    jax.device_put(a, NamedSharding(mesh, s))
    for a, s in zip((x, experts, weights, *stacks), (stream, stream, stream, wide, wide, narrow))
  ]

  @jax.jit
  def run(layer, *a):
    with rules.activation_mesh(mesh):
      return moe._sharded_dispatch(*a, backend='xla', exchange=exchange, layer=layer)

  np.testing.assert_allclose(run(1, *args), reference[False][0], rtol=1e-5, atol=1e-5)


def test_an_unknown_exchange_names_the_choices():
  with pytest.raises(ValueError, match=r"model.moe.exchange='ragged' is not one of"):
    moe._sharded_dispatch(*_inputs(), backend='xla', exchange='ragged')
  config = config_lib.defaults()
  config.model.moe.exchange = 'ragged'
  with pytest.raises(config_lib.ConfigError, match='model.moe.exchange=.ragged. is not one of'):
    config_lib.validate(config)
