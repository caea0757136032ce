"""The inference layout's routed experts read in place (ModelConfig.experts_in_place: every layer
gets the whole [layers, E, ...] stacks and its index; model/transformer.py _run_layers) against
the same layout with each layer's experts cut from the stacks: identical logits and sampler
tokens for a tiny LLaDA2-like MoE (a dense first layer, a shared expert, grouped sigmoid routing,
block routing on and off, scanned and unrolled layers, XLA's ragged_dot and the Pallas kernel in
interpret mode), and a decode program whose grouped matmuls take the stacks whole."""

import dataclasses

import jax
import numpy as np
import pytest

from dlmjax import model as model_lib
from dlmjax.diffusion import prompt_rows, sampler_programs, sampling_config
from tests.diffusion import tiny_sampler

# 3 layers: a dense first one, then a run of 2 MoE layers (so a wrong layer index is seen).
CFG = model_lib.ModelConfig(
  num_layers=3,
  d_model=32,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  ffn_dim=64,
  vocab_size=tiny_sampler.VOCAB,
  seq_len=32,
  init_std=0.3,
  attention_mask='block_causal',
  block_size=4,
  num_experts=8,
  experts_per_token=2,
  moe_ffn_dim=16,
  shared_experts=1,
  router='sigmoid_bias',
  router_groups=4,
  router_group_topk=2,
  routed_scale=2.5,
  dense_layers=(0,),
)
EXPERTS = (2, 8, 32, 16)  # one MoE run's gate / up stack: [layers, E, D, F]


def _config(scan=True, block_experts=0, backend='xla'):
  return dataclasses.replace(
    CFG, scan_layers=scan, block_experts=block_experts, moe_backend=backend
  )


@pytest.fixture(scope='module')
def params():
  params = jax.jit(model_lib.init_params, static_argnums=0)(CFG, jax.random.key(0))
  # A bias that changes the choice (its init is zeros), different in each layer.
  bias = params['blocks_1']['mlp']['router_bias']
  params['blocks_1']['mlp']['router_bias'] = jax.random.uniform(
    jax.random.key(1), bias.shape, minval=-0.3, maxval=0.3
  )
  return params


@pytest.mark.parametrize(
  'scan,block_experts,backend',
  [(True, 0, 'xla'), (True, 3, 'xla'), (False, 0, 'xla'), (False, 3, 'pallas')],
)
def test_in_place_experts_give_the_sliced_logits(params, scan, block_experts, backend):
  cfg = _config(scan, block_experts, backend)
  tokens = jax.random.randint(jax.random.key(2), (2, 12), 4, tiny_sampler.VOCAB)

  @jax.jit
  def logits(params):
    return tuple(
      model_lib.inference_module(cfg, params, experts_in_place=in_place)(tokens)
      for in_place in (True, False)
    )

  in_place, sliced = logits(params)
  np.testing.assert_array_equal(in_place, sliced)
  # The two MoE layers' experts differ, and routing reached several: the comparison can fail.
  assert np.isfinite(np.asarray(in_place)).all() and np.std(np.asarray(in_place)) > 0.1


def test_in_place_experts_decode_the_sliced_tokens(params):
  """The block-cached sampler (model.block_experts on), its whole program compiled both ways."""
  cfg = _config(block_experts=3)
  sampling = sampling_config.SamplingConfig(gen_length=8, steps=4, block_length=4, cache='block')
  prompt_BP, lengths_B = prompt_rows.pad_prompts(tiny_sampler.PROMPTS[:3], tiny_sampler.PAD)

  def decode(in_place):
    fn = sampler_programs.make_generate_fn(
      cfg,
      sampling,
      mask_id=tiny_sampler.MASK,
      eos_id=tiny_sampler.EOS,
      pad_id=tiny_sampler.PAD,
      vocab_size=tiny_sampler.VOCAB,
      experts_in_place=in_place,
    )
    return np.asarray(fn(params, prompt_BP, lengths_B, jax.random.key(0)))

  in_place = decode(True)
  np.testing.assert_array_equal(in_place, decode(False))
  assert not (in_place[:, prompt_BP.shape[1] :] == tiny_sampler.MASK).any()


def _pallas_rhs_and_scan_xs(jaxpr, rhs, xs):
  """Collects every grouped_matmul_fwd kernel's rhs shape and every scan's scanned shapes."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'pallas_call' and 'grouped_matmul_fwd' in str(eqn.params):
      rhs.append(eqn.invars[-1].aval.shape)
    if eqn.primitive.name == 'scan':
      skip = eqn.params['num_consts'] + eqn.params['num_carry']
      xs.extend(v.aval.shape for v in eqn.invars[skip:])
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, 'jaxpr', sub)
        if hasattr(inner, 'eqns'):
          _pallas_rhs_and_scan_xs(inner, rhs, xs)
  return rhs, xs


@pytest.mark.parametrize('scan', [True, False])
def test_the_decode_program_hands_the_kernel_the_whole_stacks(params, scan):
  """The generate program (traced, not compiled): every grouped matmul reads the run's whole
  expert stacks [layers, E, ...], and no layer loop scans over them; with experts_in_place off
  each kernel gets one layer's (the copy this removes), so the check can fail."""
  cfg = _config(scan=scan, block_experts=3, backend='pallas')
  sampling = sampling_config.SamplingConfig(gen_length=4, steps=2, block_length=4, cache='block')
  prompt_BP, lengths_B = prompt_rows.pad_prompts(tiny_sampler.PROMPTS[:1], tiny_sampler.PAD)
  shapes = {}
  for in_place in (True, False):
    fn = sampler_programs.make_generate_fn.__wrapped__(
      cfg,
      sampling,
      mask_id=tiny_sampler.MASK,
      eos_id=tiny_sampler.EOS,
      pad_id=tiny_sampler.PAD,
      experts_in_place=in_place,
    )
    # traced as the top-level program it is (on GPU it carries compiler options, which a jit
    # nested inside make_jaxpr may not)
    jaxpr = fn.trace(params, prompt_BP, lengths_B, jax.random.key(0)).jaxpr.jaxpr
    shapes[in_place] = _pallas_rhs_and_scan_xs(jaxpr, [], [])
  rhs, xs = shapes[True]
  down = (EXPERTS[0], EXPERTS[1], EXPERTS[3], EXPERTS[2])
  assert rhs and set(rhs) == {EXPERTS, down}, rhs
  assert EXPERTS not in xs and down not in xs
  sliced_rhs, sliced_xs = shapes[False]
  # (the kernel reads an unstacked rhs as a stack of one: a reshape of the cut layer)
  assert sliced_rhs and all(s[0] == 1 for s in sliced_rhs)
  assert not scan or EXPERTS in sliced_xs


def test_training_layout_keeps_the_cut_and_inference_config_sets_the_read():
  assert not CFG.experts_in_place
  assert model_lib.inference_config(CFG).experts_in_place
  assert not model_lib.inference_config(CFG, experts_in_place=False).experts_in_place
  dense = dataclasses.replace(CFG, num_experts=0, dense_layers=())
  assert not model_lib.inference_config(dense).experts_in_place
  fp8 = dataclasses.replace(CFG, matmul_dtype='fp8')  # its stacks would be cast in every layer
  assert not model_lib.inference_config(fp8).experts_in_place
