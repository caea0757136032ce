"""lm-evaluation-harness model `dlmjax`: loglikelihood by LLaDA's MC ELBO, text by the sampler.

  python -m dlmjax.lm_eval_adapter --model dlmjax \\
      --model_args checkpoint_path=runs/x,mc_num=128,mc_batch=32,cfg=0.5 --tasks arc_easy,piqa

lm-eval finds models only in its own registry, so this module registers `dlmjax` and then runs
lm-eval's command line (every lm-eval flag works); in Python, `import dlmjax.lm_eval_adapter`
before `lm_eval.simple_evaluate(model='dlmjax', ...)`. Needs `pip install lm-eval` (the `eval`
extra). As LLaDA's eval_llada.py: is_greedy is always False (its greedy check costs T forward
passes per request and no reported metric uses it) and loglikelihood_rolling is not offered.
"""

from __future__ import annotations

import sys

from dlmjax import extras

try:
  from lm_eval.api.model import LM
  from lm_eval.api.registry import register_model
except ImportError as e:
  _message = extras.missing_message(e, 'dlmjax.lm_eval_adapter')
  if _message is None:
    raise
  if __name__ == '__main__':  # the command line: one line, no traceback
    print(f'error: {_message}', file=sys.stderr)
    sys.exit(2)
  raise ImportError(_message, name=e.name) from e

from dlmjax import evaluate
from dlmjax.diffusion import likelihood as likelihood_lib
from dlmjax.diffusion import sampler as sampler_lib


@register_model('dlmjax')
class DlmjaxLM(LM):
  """model_args: checkpoint_path (required), mc_num, mc_batch, cfg (likelihood and sampler),
  the sampler's settings by their SamplingConfig names (gen_length, steps, block_length,
  temperature, top_p, remasking, threshold, cache, cache_refresh, stop_at_eos, alg_temp, factor;
  defaults: LLaDA's demo), seed, tokenizer, dtype; batch_size from lm-eval."""

  def __init__(
    self,
    checkpoint_path: str,
    mc_num: int = 128,
    mc_batch: int = 32,
    cfg: float = 0.0,
    seed: int = 0,
    tokenizer: str = '',
    dtype: str | None = None,
    batch_size=8,
    **kwargs,
  ):
    super().__init__()
    # Other kwargs: lm-eval's device / max_batch_size, which a JAX model does not use.
    settings = likelihood_lib.LikelihoodConfig(
      mc_num=int(mc_num), mc_batch=int(mc_batch), cfg_scale=float(cfg)
    )
    sampling = sampler_lib.SamplingConfig.from_values(
      cfg_scale=cfg, **{k: v for k, v in kwargs.items() if k in sampler_lib.FIELDS}
    )
    rows = int(batch_size) if str(batch_size).isdigit() else 8  # 'auto' -> 8
    self.model = evaluate.EvalModel(
      checkpoint_path,
      settings=settings,
      sampling=sampling,
      tokenizer=tokenizer,
      seed=int(seed),
      batch_size=rows,
      dtype=dtype,
    )

  def loglikelihood(self, requests) -> list[tuple[float, bool]]:
    scores = self.model.loglikelihood([tuple(r.args[:2]) for r in requests])
    return [(float(s), False) for s in scores]

  def loglikelihood_rolling(self, requests):
    raise NotImplementedError(
      'dlmjax scores (context, continuation) pairs; rolling perplexity '
      'has no diffusion counterpart here (as in LLaDA).'
    )

  def generate_until(self, requests) -> list[str]:
    """The sampler's completion of each context, cut at the first stop string (`until`); the
    length is model_args gen_length (max_gen_toks is not read: the canvas is fixed)."""
    texts = self.model.generate([r.args[0] for r in requests], template=False)
    out = []
    for request, text in zip(requests, texts):
      for stop in request.args[1].get('until') or []:
        if stop and stop in text:
          text = text.split(stop)[0]
      out.append(text)
    return out


def main(argv=None) -> None:
  """lm-eval's command line with `dlmjax` registered."""
  from lm_eval.__main__ import cli_evaluate  # pylint: disable=import-outside-toplevel

  if argv is not None:
    sys.argv = [sys.argv[0], *argv]
  cli_evaluate()


if __name__ == '__main__':
  sys.exit(main())
