"""The values the diffusion.* and sampler.* keys choose among, apart from the losses and the
sampler that dispatch on them: jax-free, so a config is checked before jax loads. loss.OBJECTIVES
(a function table) is tied to OBJECTIVES by tests/config_test.py; the cache modes are a registry
of their own (cache_modes/)."""

OBJECTIVES = ('mdm', 'ar', 'block')  # diffusion.objective: masked diffusion, autoregressive, BD3LM
# objective=block's softmax: BD3LM's SUBS (MASK left out) or plain CE over the whole vocabulary.
BLOCK_PARAMETERIZATIONS = ('subs', 'plain')
SAMPLER_SCHEDULES = ('auto', 'linear', 'dream')  # sampler.schedule
# sampler.remasking: low_confidence: LLaDA's softmax(logits)[x0] (the clean, un-tempered
# distribution); random: U(0, 1) (LLaDA); maskgit_plus, margin (Dream's topk_margin), entropy:
# Dream's, on the distribution x0 is drawn from (decoding.sampling_probs).
REMASKING_ORDERS = ('low_confidence', 'random', 'entropy', 'margin', 'maskgit_plus')
