"""The configuration schema: every key, its default, derived values and cross-field validation.

One source of truth: configs/*.py start from `defaults()` and set only what differs; code reads
keys directly (never `config.get(key, default)`), so an unknown override fails at parse time.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import numbers
import os

import ml_collections


class ConfigError(ValueError):
  """A config that cannot work; the message names the key and the fix."""


def defaults() -> ml_collections.ConfigDict:
  """Every key with its default; the meaning of each beside it (docs by topic in README.md)."""
  c = ml_collections.ConfigDict()
  c.stage = 'pretrain'  # pretrain | sft | rl: selects the batch source and loss.
  c.output_dir = 'runs/default'  # the run directory: checkpoints, config.json, metrics.jsonl.
  c.seed = 1234  # parameter init, masks and data order derive from it.
  c.init_from = ''  # a checkpoint to start from when output_dir has none (fine-tuning stages).

  c.model = ml_collections.ConfigDict()
  c.model.num_layers = 2  # transformer blocks.
  c.model.d_model = 128  # the residual width.
  c.model.num_heads = 4  # query heads.
  c.model.num_kv_heads = 4  # key/value heads (grouped-query attention when fewer).
  c.model.head_dim = 32  # per head (q, k, v).
  c.model.ffn_dim = 384  # the SwiGLU hidden width.
  # The tokenizer's vocabulary; the embedding is padded to a multiple of VOCAB_MULTIPLE (fixed, so
  # checkpoints keep their shapes on any mesh; mesh.tensor must divide the padded size).
  c.model.vocab_size = 4096
  c.model.seq_len = 128  # tokens per row: the canvas of every stage.
  c.model.rope_theta = 10000.0  # RoPE base.
  # RoPE frequency scaling: '' (none) | 'llama3:factor=8,low_freq_factor=1,high_freq_factor=4,
  # original_max_position_embeddings=8192' (Llama-3.1/3.2) | 'linear:factor=F'
  # (parse_rope_scaling; dlmjax/model/layers.py rope_inv_freq).
  c.model.rope_scaling = ''
  # The share of each head's dims RoPE rotates (transformers' partial_rotary_factor; LLaDA2: 0.5):
  # the first int(head_dim x fraction) dims rotate, the rest pass through.
  c.model.rope_fraction = 1.0
  c.model.norm_eps = 1e-6  # RMSNorm epsilon.
  # RMSNorm on q and k over the head dim before RoPE (Qwen3); off: straight to RoPE (Qwen2, Llama).
  c.model.qk_norm = True
  c.model.qkv_bias = False  # biases on the q, k and v projections (Qwen2); o has none.
  # Dream's alignment: token i is predicted by the output at position i-1 (position 0: its own).
  c.model.shift_logits = False
  c.model.init_std = 0.02  # normal init std (output projections: / sqrt(2 x layers), Megatron).
  c.model.tie_embeddings = False  # the output head reuses the embedding.
  c.model.attention_mask = 'bidirectional'  # bidirectional | causal | block_causal
  c.model.block_size = 32  # block_causal only: tokens per block.
  c.model.attention_backend = 'xla'  # xla | cudnn | pallas | auto (fastest valid; attention.py)
  # RMSNorm (and the QK-norm with RoPE): xla | pallas (one kernel pass each way,
  # kernels/rms_norm.py) | auto (the kernel on GPU where it applies).
  c.model.norm_backend = 'xla'
  c.model.dtype = 'float32'  # compute dtype: float32 | bfloat16; params stay float32.
  # Mixture of experts (dlmjax/model/moe.py): num_experts > 0 makes each layer's MLP an MoE of
  # that many SwiGLU experts of width moe_ffn_dim (0 = model.ffn_dim), experts_per_token chosen per
  # token by model.router: softmax_topk (weights renormalised, Qwen3-MoE) | softmax_topk_raw (raw
  # softmax weights, LLaDA-MoE / OLMoE) | sigmoid_bias (DeepSeek-V3 loss-free balancing);
  # shared_experts > 0 adds a dense SwiGLU of shared_experts x moe_ffn_dim every token passes.
  # dense_layers: comma-separated layer indices ('0,1') whose MLP stays the dense one of ffn_dim
  # in an MoE model (Qwen3-MoE's mlp_only_layers / decoder_sparse_step, DeepSeek's
  # first_k_dense_replace; dense_layer_indices derives it); '' = every layer MoE.
  c.model.num_experts = 0
  c.model.dense_layers = ''
  c.model.experts_per_token = 2
  c.model.moe_ffn_dim = 0
  c.model.shared_experts = 0
  c.model.router = 'softmax_topk'
  # Group-limited routing (sigmoid_bias only; DeepSeek-V3's n_group / topk_group, LLaDA2's): the
  # experts form router_groups equal groups, each scored by the sum of its two best biased
  # scores, and a token's experts_per_token are chosen among its router_group_topk best groups
  # (1 / 1: no grouping). routed_scale multiplies the routed experts' weights
  # (routed_scaling_factor; the shared experts' output is not scaled).
  c.model.router_groups = 1
  c.model.router_group_topk = 1
  c.model.routed_scale = 1.0
  # The experts' grouped matmul (kernels/grouped_matmul.py): xla (ragged_dot) | tokamax | pallas
  # (our Triton kernels) | auto (pallas on GPU, measured fastest: docs/benchmarks.md MoE; else xla).
  c.model.moe_backend = 'auto'
  # How tokens reach experts split over mesh.expert (model/moe.py): gather (all-gather the expert
  # group's tokens, reduce-scatter the outputs: 2 x expert x local activations per layer) |
  # all_to_all (send each assignment to its expert's device and back: dropless, so a dense
  # worst-case buffer of min(k, experts per device) times that; equal with one expert a device).
  c.model.moe_exchange = 'gather'
  # The projections' matmuls (q/k/v/o, MLP gate/up/down): 'compute' runs them in model.dtype,
  # 'fp8' in FP8 on Hopper (e4m3 forward, e5m2 gradients, per-tensor scales; model/fp8.py). The
  # output head and the attention core stay in model.dtype either way.
  c.model.matmul_dtype = 'compute'
  c.model.remat = 'none'  # a policy in model/transformer.py REMAT_POLICIES
  c.model.scan_layers = True  # the layer stack as one scanned layer (fast compiles).
  # Output head + cross-entropy fused over chunks of this many tokens (never materialising fp32
  # [tokens, vocab] logits); 0 computes the full logits first.
  c.model.loss_chunk_tokens = 4096
  c.model.mask_token_id = 3  # the tokenizer's ids of MASK, EOS and padding.
  c.model.eos_token_id = 2
  c.model.pad_token_id = 0

  c.diffusion = ml_collections.ConfigDict()
  # mdm (masked diffusion) | ar (autoregressive baseline) | block (BD3LM block diffusion over
  # [x_t || x_0], a t per model.block_size block; needs attention_mask=block_causal).
  c.diffusion.objective = 'mdm'
  c.diffusion.varlen_prob = 0.01  # share of micro-batches truncated to a random length.
  # objective=block's softmax: subs (BD3LM's SUBS, the MASK logit -inf before the log-softmax:
  # the default, as bd3lm.yaml trains) or plain (CE over the whole vocabulary, MASK included).
  # mdm and ar keep plain CE (MegaDLMs, LLaDA). docs/block_diffusion.md.
  c.diffusion.block_parameterization = 'subs'

  c.data = ml_collections.ConfigDict()
  # builtin | megatron | tfds:NAME:SPLIT (the `tfds` extra; TFDS_DATA_DIR says where the prepared
  # datasets live).
  c.data.source = 'builtin'
  c.data.train_prefixes = ''  # Megatron blend: "0.7 /data/a 0.3 /data/b" or "/data/a".
  c.data.valid_prefixes = ''  # the held-out blend; '' = data.split's valid share of the train one.
  c.data.split = '969,30,1'  # Megatron's train,valid,test shares of the train blend.
  c.data.tokenizer = ''  # tokenizer.json / .model; '' = the built-in corpus's.
  c.data.cache_dir = ''  # built corpora, tokenizers, indices; '' = $DLMJAX_CACHE_DIR or ~/.cache.
  c.data.num_workers = 0  # loader worker processes (0 = in the main process).
  c.data.prefetch = 2  # batches read ahead.
  # Renames the columns of sft.*_file / rl.task_data rows (jsonl, parquet, json, arrow, csv or
  # hub:NAME[:CONFIG][@SPLIT], dlmjax/data/records.py): 'prompt=question,response=answer'.
  c.data.columns = ''
  # Document-aware packing: attention, RoPE positions and the mask ratio t stay inside each
  # document (pretrain: split at model.eos_token_id; sft: each conversation) of a row; off packs
  # pretraining as Megatron (documents see each other) and pads SFT rows with EOS that is trained
  # (LLaDA). xla or pallas attention.
  c.data.packing = False
  # A resume whose data differ from the checkpoint's (source, prefixes and blend, split, seq_len,
  # seed, file sizes: dlmjax/train/data_fingerprint.py) is refused; True says the change is
  # intended (a new phase of training): the data position restarts at the new data's first
  # sample while the model, optimizer and step resume. On unchanged data it does nothing.
  c.data.new_phase = False

  c.train = ml_collections.ConfigDict()
  c.train.steps = 200  # optimizer steps; the schedule ends here.
  c.train.exit_at_step = 0  # stop (with a checkpoint) on reaching this step; 0 = run to the end.
  # > 0: stop cleanly, with a checkpoint, before this many minutes of training have passed (a
  # job's time limit; the last step and save are budgeted from the slowest seen).
  c.train.max_minutes = 0.0
  # Rows per optimizer step, and rows per accumulation step across the WHOLE mesh (Megatron's
  # per-rank micro-batch times the data-parallel size). Both are mesh-independent, so a run gives
  # the same losses on any mesh.
  c.train.global_batch_size = 32
  c.train.micro_batch_size = 16
  c.train.lr = 3e-3  # peak learning rate.
  c.train.min_lr = 3e-4  # the rate the decay ends at.
  # wsd (warmup-stable-decay, exponential anneal: MegaDLMs) | wsd_linear | wsd_cosine | cosine |
  # constant (train/optimizer.py).
  c.train.schedule = 'wsd'
  c.train.warmup_steps = 20  # linear warmup from 0.
  c.train.decay_steps = 0  # cosine: steps to decay over after warmup (0 = until train.steps).
  c.train.wsd_decay_steps = 40  # wsd*: length of the final anneal.
  c.train.b2 = 0.95  # AdamW's beta2 (beta1 0.9, eps 1e-8).
  c.train.weight_decay = 0.1  # decoupled, on matrices only (never norms).
  c.train.clip_grad_norm = 1.0  # global gradient-norm clip.
  # MoE router losses added to the training objective (model.num_experts > 0; 0 = off): the
  # load-balancing loss (k at perfect balance) and the router z-loss, each times its coefficient;
  # moe_bias_rate: the sigmoid_bias router's per-step bias update (DeepSeek-V3's gamma).
  c.train.moe_balance_loss = 0.0
  c.train.moe_z_loss = 0.0
  c.train.moe_bias_rate = 0.001
  # A non-finite loss or gradient skips the update; this many in a row stop the run (0 = never).
  c.train.max_consecutive_skips = 10
  # Divergence (dlmjax/train/divergence.py): a non-finite step, or (pre-training) a loss above
  # spike_factor x the mean of the last spike_window finite losses (0 = spikes unchecked), keeps
  # the last good checkpoint out of rotation; rollback_on_divergence also restores it and trains
  # on, skipping the data since it (the step counter and data position stay).
  c.train.spike_factor = 3.0
  c.train.spike_window = 20
  c.train.rollback_on_divergence = False
  # Refuse at start a config whose estimated memory per device (dlmjax/train/memory.py)
  # exceeds the GPU's; False skips the check.
  c.train.check_memory = True
  # LoRA (dlmjax/model/lora.py, docs/lora.md): rank > 0 trains adapters y = xW + (alpha/rank) xAB
  # on the targeted projections of the frozen init_from model; 0 = full fine-tuning.
  c.train.lora = ml_collections.ConfigDict()
  c.train.lora.rank = 0
  c.train.lora.alpha = 16.0  # the adapters' scale is alpha / rank (PEFT's lora_alpha).
  c.train.lora.dropout = 0.0  # PEFT's lora_dropout: on the adapters' input, in training only.
  c.train.lora.targets = 'q,k,v,o,gate,up,down'  # comma-separated subset of these projections.
  # The frozen base's storage: bfloat16 | float32 | int8 (projections int8 per output channel) |
  # nf4 | int4 (QLoRA: 4-bit projections, one absmax per 64 inputs; docs/lora.md).
  c.train.lora.base_dtype = 'bfloat16'
  c.train.lora.init_adapter = ''  # a PEFT adapter directory to start the adapters from.

  # Devices per mesh axis; one axis may be -1: it takes whatever the others leave (default: FSDP
  # over every device, MaxText's default inside a node).
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.tensor = 1
  c.mesh.pipeline = 1
  # Pipeline and context parallelism (README, "Batches and meshes"): the layer stack runs as
  # mesh.pipeline stages, each micro-batch split into pipeline_microbatches (0 = one per stage);
  # repeats > 1 makes the schedule circular (layer l sits on stage
  # (l // (layers / (pipeline x repeats))) % pipeline), shrinking the bubble
  # (pipeline-1) / (repeats x microbatches + pipeline-1). mesh.context splits the sequence
  # (attention all-to-alls to heads; weights are sharded over it as over fsdp).
  c.mesh.pipeline_repeats = 1
  c.mesh.pipeline_microbatches = 0
  c.mesh.context = 1
  # Expert parallelism: the MoE experts are split over mesh.expert devices (model.num_experts a
  # multiple of it); the batch is split over it too, as over data and fsdp.
  c.mesh.expert = 1

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 100  # 0 turns periodic saves off (the final step is still saved).
  c.checkpoint.keep = 3  # the newest checkpoints kept.
  c.checkpoint.every_minutes = 0.0  # > 0: also save when this long has passed since the last save.
  c.checkpoint.keep_every = 0  # > 0: checkpoints of steps divisible by it are kept for good.

  # Observability (README, "Faults and watching a run"): every logged row goes to metrics.jsonl,
  # log.outputs, comma-separated from: tensorboard (scalars under OUTPUT_DIR/tensorboard, no
  # TensorFlow needed), wandb (Weights & Biases offline under OUTPUT_DIR/wandb, project
  # $WANDB_PROJECT or dlmjax; needs wandb), plots (PNGs of loss/throughput/reward in
  # OUTPUT_DIR/plots at the end; needs matplotlib). MFU uses the device kind's peak.
  c.log = ml_collections.ConfigDict()
  c.log.every = 10  # steps between logged rows.
  c.log.outputs = 'tensorboard,plots'

  # Supervised fine-tuning (stage sft): LLaDA's recipe (dlmjax/data/sft.py, diffusion/sft_loss.py).
  c.sft = ml_collections.ConfigDict()
  # jsonl rows {"prompt", "response"} or {"messages": [{"role", "content"}, ...]}; '' with
  # data.source=builtin: the built-in instruction set made from dlmjax.tasks (no download).
  c.sft.train_file = ''
  c.sft.eval_file = ''  # held-out jsonl for val_loss (eval.every); builtin: the tasks' test split
  c.sft.chat_template = 'plain'  # none | plain | llada | chatml | dream (dlmjax/data/chat.py)
  c.sft.too_long = 'drop'  # rows longer than model.seq_len: truncate | drop | error

  # Evaluation (README, "Evaluation"; dlmjax/train/evaluation.py): the stage's loss on the
  # held-out ('valid') split, logged as val_loss / val_masked_ce, with masks from a fixed seed and
  # the example index, never the step, so every evaluation of a run scores the same tokens masked
  # the same way. Stage rl instead decodes rl.task's problems (rl.eval_split) greedily with the
  # rollout sampler and logs val_reward / val_accuracy (eval.batches x train.global_batch_size
  # problems).
  c.eval = ml_collections.ConfigDict()
  c.eval.every = 0  # steps between evaluations (and at the last step); 0 turns them off.
  c.eval.batches = 4  # global batches of the valid split per evaluation.

  # The masked-diffusion sampler (dlmjax/diffusion/sampler.py, SamplingConfig.from_config): RL's
  # rollouts and held-out decoding (at temperature 0) read it. generate, evaluate and the lm-eval
  # adapter take the same settings as flags / model_args, defaulting to LLaDA's demo.
  c.sampler = ml_collections.ConfigDict()
  c.sampler.gen_length = 64  # completion tokens (the canvas after the prompt).
  c.sampler.steps = 32  # denoising steps over the whole completion (a multiple of its blocks).
  c.sampler.block_length = 32  # semi-autoregressive blocks, decoded left to right.
  c.sampler.temperature = 0.9  # 0 = greedy; else Gumbel-max sampling at this temperature.
  c.sampler.top_p = 1.0  # nucleus filter before the temperature (1 = off).
  c.sampler.cfg_scale = 0.0  # classifier-free guidance against a masked prompt (0 = off).
  # The decoding order, which tokens commit first: LLaDA's low_confidence | random, Dream's
  # entropy | margin | maskgit_plus (dlmjax/diffusion/decoding.py).
  c.sampler.remasking = 'low_confidence'
  c.sampler.threshold = 0.0  # > 0: also commit every masked token this confident (Fast-dLLM).
  # none | truncate | prefix | dual | block. truncate: the canvas after the current block is not
  # computed; block: a K/V cache of prompt and committed blocks (both exact only under causal or
  # block-causal attention); prefix / dual: Fast-dLLM's approximate caches, refreshed per block.
  c.sampler.cache = 'none'
  # Rows whose text is final (an EOS, nothing masked before it) stop changing; a block ends when
  # every other row is done and the block loop once every row is (the text is unchanged): with
  # cache=block, SDAR's any-length block decoding, gen_length its maximum.
  c.sampler.stop_at_eos = False
  c.sampler.alg_temp = 0.0  # > 0: draw the positions from softmax(confidence / alg_temp) (Dream)
  # > 0: also commit the n most confident tokens with (n + 1)(1 - c_n) <= factor (Fast-dLLM).
  c.sampler.factor = 0.0
  c.sampler.cache_refresh = 0  # prefix / dual: also refresh the K/V every k steps (0 = off).
  # Tokens each step commits: linear (LLaDA's even split) | dream (Dream's int(m (1 - s/t)) of
  # the m still masked, t on linspace(1, eps)) | auto (Dream's for shifted-logit, Dream-family
  # models, else linear). dlmjax/diffusion/schedules.py.
  c.sampler.schedule = 'auto'
  c.sampler.eps = 1e-3  # Dream's schedule: the last time of linspace(1, eps, steps + 1).
  # True: the decoding orders score softmax(logits) with MASK's logit in it, as LLaDA and Dream
  # do; MASK is never predicted either way (docs/differences.md, "MASK in the sampler").
  c.sampler.mask_in_softmax = False

  # Reinforcement learning (stage rl, README "Reinforcement learning"): dlmjax/rl,
  # dlmjax/train/stages/rl.py. Advantages are r - group mean, a token mean over the batch (d1's
  # is per micro-batch) and d1's frozen-init KL reference (kl_beta 0 = none); the peers'
  # alternatives are parameters of dlmjax/rl/advantages.py and rollout.loss_weights.
  c.rl = ml_collections.ConfigDict()
  # a dlmjax.tasks name; the file tasks (gsm8k, math500, countdown, sudoku, code) read rl.task_data
  c.rl.task = 'countdown3'
  c.rl.task_data = ''  # file tasks: TRAIN[,TEST] (jsonl, parquet, ... or hub:NAME@SPLIT)
  # Code tasks run model-written programs inside an OS boundary (bubblewrap; docs/evaluation.md,
  # Code sandbox); where the machine has none the run stops at start-up, unless this is True:
  # then they run behind the audit hook and rlimits alone (no defence against hostile code).
  c.rl.allow_unsandboxed_code = False
  c.rl.num_prompts = 1024  # training prompts drawn from the task's train split
  c.rl.max_prompt_tokens = 48  # prompt width; longer prompts are dropped
  c.rl.group_size = 4  # G completions per prompt; train.global_batch_size rows per rollout
  c.rl.inner_updates = 2  # mu: optimizer steps per rollout batch (d1: 8 countdown/sudoku)
  # d1 (diffu-GRPO, per-token one-step) | espo (sequence ELBO ratio) | spg (ELBO / EUBO bounds)
  # | wd1 (ratio-free weighted likelihood, no KL) | wd1pp (wd1++: every decoding step's predicted
  # completion, weighted over the G x steps predictions; needs sampler.cache=none)
  # | coupled_grpo (DiffuCoder: complementary-mask token estimate, leave-one-out advantages)
  # | trace (TraceRL, block-causal models: each token scored in the sampler's state that
  # committed it). Each run prints its objective's switches.
  c.rl.objective = 'd1'
  c.rl.kl_beta = 0.04  # d1's beta (k3; k2 for espo) against the reference; 0 = no KL.
  # d1's sync_ref_model (TRL's SyncRefModelCallback): every N steps the reference becomes
  # alpha * policy + (1 - alpha) * reference (d1: N 64, TRL's ref_model_mixup_alpha 0.6); 0 = the
  # frozen init model. The reference is then part of the train state (checkpointed, resumed).
  c.rl.ref_sync_every = 0
  c.rl.ref_sync_alpha = 0.6
  c.rl.clip_eps = 0.5  # d1's epsilon
  c.rl.p_mask_prompt = 0.15  # d1: prompt tokens masked in the one-step estimate
  c.rl.elbo_samples = 2  # espo, spg: Monte Carlo mask samples per sequence (ESPO's M, SPG's m)
  # spg: negative-advantage rows use mix_weight * EUBO + (1 - mix_weight) * ELBO (1 = EUBO alone,
  # 0 = ELBO alone); eubo_beta is the Renyi order (SPG: 1.0 for sudoku, 1.5 for the others).
  # Masks are SPG's block-wise ones over sampler.block_length blocks. SPG has no KL: kl_beta = 0.
  c.rl.spg_mix_weight = 0.5
  c.rl.spg_eubo_beta = 1.0
  # wd1pp (wd1 paper v2, Eq. 10): w+- = softmax(+-psi A) over a prompt's G x steps predictions.
  c.rl.wd1pp_psi = 1.0
  # wd1pp's factor: L / G x 1 / t_l (True: DCE's 1 / t, t_l = the masked share of the canvas in
  # the drawn step's state x_l; our reading of the paper's garbled "L / G l") or L / G (False).
  c.rl.wd1pp_dce_weight = True
  c.rl.reference_dtype = 'float32'  # float32 | bfloat16 (halves the reference's memory)
  c.rl.reference_on_host = False  # keep the reference in host memory between rollouts
  # eval.every's problems: test (the task's test split) | valid (train-split problems outside
  # rl.num_prompts' set: for choosing a checkpoint without looking at the test split)
  c.rl.eval_split = 'test'
  # MoE: whether RL's objective gets the router losses of train.moe_balance_loss / moe_z_loss.
  c.rl.router_losses = False
  return c


# Keys this version no longer has: old name -> the new key, or why it went. A command-line
# override or a config file setting one fails naming this; a saved run's config.json maps the
# renamed ones (from_dict).
RENAMED = {
  'rl.gen_length': 'sampler.gen_length',
  'rl.diffusion_steps': 'sampler.steps',
  'rl.block_length': 'sampler.block_length',
  'rl.temperature': 'sampler.temperature',
  'sft.packing': 'data.packing',
}
REMOVED = {
  'rl.advantage_scaling': 'advantages are r - group mean (std scaling: a parameter of '
  'dlmjax/rl/advantages.py)',
  'rl.negative_advantages': 'every advantage is kept (dropping negatives: a parameter of '
  'dlmjax/rl/advantages.py)',
  'rl.loss_normalisation': "the loss is a token mean over the batch (GRPO's per sequence: a "
  'parameter of dlmjax/rl/rollout.py loss_weights)',
  'rl.kl_reference': 'the KL reference is the init model; rl.kl_beta=0 turns the KL off',
  'sft.supervise_padding': 'EOS padding is supervised unless data.packing=True',
  'sft.normalisation': "LLaDA's per-answer-length normalisation (others: a parameter of "
  'dlmjax/diffusion/sft_loss.py)',
  'sft.weight_by_inverse_t': "LLaDA's 1/p weight (a parameter of dlmjax/diffusion/sft_loss.py)",
  'sft.time_eps': "LLaDA's 1e-3 (a parameter of dlmjax/diffusion/sft_loss.py)",
  'log.tensorboard': 'use log.outputs (comma-separated: tensorboard,wandb,plots)',
  'log.wandb': 'use log.outputs (comma-separated: tensorboard,wandb,plots)',
  'log.plots': 'use log.outputs (comma-separated: tensorboard,wandb,plots)',
  'log.wandb_project': 'wandb reads the WANDB_PROJECT environment variable',
  'log.peak_tflops': "MFU uses the device kind's peak (dlmjax/train/reporting.py)",
  'model.preset': 'config files apply presets with dlmjax.model.presets.apply_preset; the '
  'command line takes --config.model.preset=NAME',
  'model.vocab_multiple': 'the embedding pads to config.VOCAB_MULTIPLE (128, Megatron)',
  'data.tfds_data_dir': 'TFDS reads the TFDS_DATA_DIR environment variable',
  'checkpoint.async_save': 'checkpoints are always saved asynchronously',
  'train.eps': "AdamW's epsilon is 1e-8 (dlmjax/train/optimizer.py)",
  'train.b1': "AdamW's beta1 is 0.9 (dlmjax/train/optimizer.py); beta2 stays train.b2",
  'train.wsd_decay_style': 'the anneal is part of train.schedule: wsd (exponential) | '
  'wsd_linear | wsd_cosine',
  'eval.seed': 'evaluation masks and problems come from a fixed seed (dlmjax/train/evaluation.py)',
}

# Held-out masks and RL's held-out problems come from this seed and each example's index, so every
# evaluation of every run scores the same tokens masked the same way (dlmjax/train/evaluation.py).
EVAL_SEED = 0
# The embedding's rows are a multiple of this, whatever the mesh: a checkpoint's shapes must not
# depend on the layout it was trained on (docs/faults.md, "Mesh change on resume"). Megatron pads to
# 128 x tensor; 128 is divisible by every power-of-two tensor size up to 128.
VOCAB_MULTIPLE = 128


def old_key_message(dotted: str) -> str | None:
  """The one line telling a user of an old key what replaced it, or None for other keys."""
  if dotted in RENAMED:
    return f'{dotted} is now {RENAMED[dotted]}.'
  if dotted in REMOVED:
    return f'{dotted} is no longer a key: {REMOVED[dotted]}.'
  return None


def from_dict(values: dict) -> ml_collections.ConfigDict:
  """The defaults updated with saved values (a run's config.json): renamed keys map to their new
  names, keys this version no longer has are ignored, so old run directories stay loadable."""
  values = _flatten(values)
  if values.get('sft.packing'):
    values['data.packing'] = True
  style = values.get('train.wsd_decay_style', 'exponential')
  if values.get('train.schedule') == 'wsd' and style != 'exponential':
    values['train.schedule'] = f'wsd_{style}'
  outputs = [name for name in ('tensorboard', 'wandb', 'plots') if values.get(f'log.{name}')]
  if any(f'log.{name}' in values for name in ('tensorboard', 'wandb', 'plots')):
    values['log.outputs'] = ','.join(outputs)
  for old, new in RENAMED.items():
    if old in values and old != 'sft.packing':
      values.setdefault(new, values[old])
  config = defaults()
  for dotted, value in values.items():
    try:
      default = get_key(config, dotted)
    except (KeyError, TypeError):
      continue
    if isinstance(default, ml_collections.ConfigDict):
      continue
    parent, leaf = _parent(config, dotted)
    parent[leaf] = type(default)(value) if default is not None else value
  return config


def _flatten(values: dict, prefix: str = '') -> dict:
  flat = {}
  for key, value in values.items():
    if isinstance(value, dict):
      flat.update(_flatten(value, f'{prefix}{key}.'))
    else:
      flat[f'{prefix}{key}'] = value
  return flat


def _parent(config, dotted: str):
  *parents, leaf = dotted.split('.')
  node = config
  for part in parents:
    node = node[part]
  return node, leaf


# ----------------------------------------------------------------------------------------------
# Config files and dotted overrides: the one loader and the one override applier


def load_file(spec: str) -> ml_collections.ConfigDict:
  """`configs/x.py` or `configs/x.py:arg` -> that file's get_config(arg), checked for old keys.

  A key the file sets that defaults() lacks fails naming its replacement (or its closest fix).
  """
  path, _, arg = spec.partition(':')
  if not os.path.isfile(path):
    raise ConfigError(
      f'cannot load the --config file {path}: it does not exist (pass a path '
      'such as configs/tiny.py[:ARG]).'
    )
  module_spec = importlib.util.spec_from_file_location('dlmjax_config_file', path)
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
    config = module.get_config(arg) if arg else module.get_config()
  except ConfigError:
    raise
  except Exception as e:  # a config file is user code: its error, one line, naming the file.
    raise ConfigError(f'cannot load the --config file {spec}: {type(e).__name__}: {e}') from e
  check_keys(config, source=path)
  return config


def check_keys(config, *, source: str = 'the config') -> None:
  """Raises ConfigError for the first key that defaults() lacks, naming what replaced it."""
  known = _flatten(defaults().to_dict())
  for dotted in _flatten(config.to_dict()):
    if dotted not in known:
      message = old_key_message(dotted) or f'{dotted} is not a config key.'
      raise ConfigError(f'{source}: {message}')


PRESET_OVERRIDE = 'model.preset'  # not a key: the override that sets a whole preset's fields


def apply_overrides(config, overrides, presets: dict | None = None) -> ml_collections.ConfigDict:
  """Sets dotted keys in place and returns the config.

  `overrides` is a dict {dotted key: value} (values as they are, or strings parsed as the
  default's type) or a list of "dotted.key=value" / "--config.dotted.key=value" strings. An old
  key fails naming the new one; an unknown key fails naming the group's keys. With `presets`
  (dlmjax.model.presets.PRESETS, which the command lines pass: this layer cannot import it),
  model.preset=NAME sets every field of that preset where it stands, so later overrides win.
  """
  if not isinstance(overrides, dict):
    pairs = {}
    for item in overrides:
      text = item[len('--config.') :] if item.startswith('--config.') else item
      if '=' not in text:
        raise ConfigError(f'override {item!r} is not KEY=VALUE (e.g. --config.train.steps=10).')
      key, value = text.split('=', 1)
      pairs[key] = value
    overrides = pairs
  for dotted, value in overrides.items():
    if dotted == PRESET_OVERRIDE and presets is not None:
      if value not in presets:
        raise ConfigError(f'model.preset={value!r} is not a preset; known: {sorted(presets)}.')
      config.model.update(presets[value])
      continue
    message = old_key_message(dotted)
    if message:
      raise ConfigError(message)
    try:
      parent, leaf = _parent(config, dotted)
      default = parent[leaf]
    except (KeyError, AttributeError, TypeError):
      raise ConfigError(_unknown_key_message(config, dotted)) from None
    if isinstance(default, ml_collections.ConfigDict):
      raise ConfigError(f'{dotted} is a group; set one of its keys ({sorted(default.keys())}).')
    parent[leaf] = _parse(dotted, value, default)
  return config


def _unknown_key_message(config, dotted: str) -> str:
  """'a.b is not a config key', with the closest key of its group."""
  group, _, leaf = dotted.rpartition('.')
  try:
    node = get_key(config, group) if group else config
    names = list(node.keys())
  except (KeyError, AttributeError, TypeError):
    group, names, leaf = '', list(config.keys()), dotted.split('.')[0]
  close = difflib.get_close_matches(leaf, names, n=1)
  hint = f' Did you mean "{close[0]}"?' if close else f' {group or "The top level"} has {names}.'
  return f'{dotted} is not a config key (every key is in dlmjax/config.py).{hint}'


def _parse(dotted: str, value, default):
  """value as the default's type; strings (the command line's) are parsed."""
  if default is None:
    return value
  kind = type(default)
  if isinstance(value, str) and kind is not str:
    if kind is bool:
      if value.lower() not in ('true', 'false', '1', '0'):
        raise ConfigError(f'{dotted}={value!r} is not a bool; use true or false.')
      return value.lower() in ('true', '1')
    try:
      return kind(value)
    except ValueError as e:
      try:  # 1e-4 for an int key, or 1e6 written for 1000000
        number = float(value)
      except ValueError:
        raise ConfigError(f'{dotted}={value!r}: {e} (the default is {default!r}).') from None
      if kind is int and number != int(number):
        raise ConfigError(f'{dotted}={value!r} is not an integer.') from None
      return kind(number)
  if kind is bool or isinstance(value, bool):
    if not (kind is bool and isinstance(value, bool)):
      raise ConfigError(f'{dotted}={value!r} and its default {default!r} differ in type.')
    return value
  if kind in (int, float) and isinstance(value, (int, float)):
    if kind is int and value != int(value):
      raise ConfigError(f'{dotted}={value!r} is not an integer.')
    return kind(value)
  if not isinstance(value, kind):
    raise ConfigError(f'{dotted}={value!r} is not a {kind.__name__} (the default is {default!r}).')
  return value


def parse_command_line(argv, default_file: str, presets: dict | None = None):
  """(config, the other arguments) from a command line with --config=FILE[:ARG] and
  --config.KEY=VALUE overrides, for the CLIs: the file is loaded with load_file, the overrides
  applied with apply_overrides (with `presets` for --config.model.preset=NAME), in that order
  wherever they stand."""
  spec, overrides, rest = default_file, [], []
  args = list(argv)
  i = 0
  while i < len(args):
    arg = args[i]
    if arg.startswith('--config='):
      spec = arg[len('--config=') :]
    elif arg == '--config' and i + 1 < len(args):
      spec = args[i + 1]
      i += 1
    elif arg.startswith('--config.'):
      if '=' not in arg and i + 1 < len(args):
        arg = f'{arg}={args[i + 1]}'
        i += 1
      overrides.append(arg)
    else:
      rest.append(arg)
    i += 1
  return apply_overrides(load_file(spec), overrides, presets), rest


# ----------------------------------------------------------------------------------------------
# Derived values

# model.rope_scaling: each type and the fields its formula reads (transformers' rope_type names).
ROPE_SCALING_FIELDS = {
  'llama3': ('factor', 'low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings'),
  'linear': ('factor',),
}


def parse_rope_scaling(text: str) -> tuple[str, dict] | None:
  """model.rope_scaling 'TYPE:k=v,...' -> (type, {field: float}), or None for ''."""
  if not text:
    return None
  kind, _, rest = text.partition(':')
  fix = "write it as 'TYPE:field=value,...' with TYPE one of " + ', '.join(
    f'{k} ({", ".join(v)})' for k, v in ROPE_SCALING_FIELDS.items()
  )
  if kind not in ROPE_SCALING_FIELDS:
    raise ConfigError(f'model.rope_scaling={text!r}: unknown type {kind!r}; {fix}.')
  fields = {}
  for item in filter(None, rest.split(',')):
    key, _, value = item.partition('=')
    try:
      fields[key.strip()] = float(value)
    except ValueError:
      raise ConfigError(
        f'model.rope_scaling={text!r}: {item!r} is not field=number; {fix}.'
      ) from None
  if sorted(fields) != sorted(ROPE_SCALING_FIELDS[kind]):
    raise ConfigError(
      f'model.rope_scaling={text!r}: {kind} takes exactly {", ".join(ROPE_SCALING_FIELDS[kind])}.'
    )
  if kind == 'llama3' and not fields['high_freq_factor'] > fields['low_freq_factor']:
    raise ConfigError(f'model.rope_scaling={text!r}: high_freq_factor must exceed low_freq_factor.')
  return kind, fields


def format_rope_scaling(kind: str, fields: dict) -> str:
  """The model.rope_scaling string of a type and its fields (the inverse of parse_rope_scaling)."""
  return f'{kind}:' + ','.join(f'{k}={fields[k]:g}' for k in ROPE_SCALING_FIELDS[kind])


def padded_vocab_size(config) -> int:
  """The embedding rows: vocab rounded up to VOCAB_MULTIPLE, independent of the mesh."""
  return int(math.ceil(config.model.vocab_size / VOCAB_MULTIPLE) * VOCAB_MULTIPLE)


def num_microbatches(config) -> int:
  return config.train.global_batch_size // config.train.micro_batch_size


def batch_parallelism(config) -> int:
  """Devices the batch is split over (data x fsdp x expert)."""
  return config.mesh.data * config.mesh.fsdp * config.mesh.expert


def mesh_size(config) -> int:
  m = config.mesh
  return m.data * m.fsdp * m.expert * m.tensor * m.pipeline * m.context


def pipeline_microbatches(config) -> int:
  """Pipeline micro-batches per train micro-batch (0 in the config = one per stage)."""
  return config.mesh.pipeline_microbatches or config.mesh.pipeline


# The mesh's axes in its order, outermost (slowest links) first (dlmjax/parallel/mesh.py).
MESH_AXES = ('pipeline', 'data', 'fsdp', 'expert', 'context', 'tensor')


def resolve_mesh(config, num_devices: int) -> None:
  """Replaces a -1 mesh axis, in place, by the size that makes the mesh fill num_devices."""
  mesh = config.mesh
  fill = [axis for axis in MESH_AXES if mesh[axis] == -1]
  if len(fill) > 1:
    raise ConfigError(f'mesh axes {fill} are all -1; at most one axis can fill the devices.')
  if not fill:
    return
  others = 1
  for axis in MESH_AXES:
    if axis != fill[0]:
      others *= max(mesh[axis], 1)
  if num_devices % others:
    raise ConfigError(
      f'mesh.{fill[0]}=-1 cannot fill {num_devices} devices: the other axes '
      f'multiply to {others}, which does not divide it.'
    )
  mesh[fill[0]] = num_devices // others


# ----------------------------------------------------------------------------------------------
# Validation

_CHOICES = {
  'stage': ('pretrain', 'sft', 'rl'),
  'rl.objective': ('d1', 'espo', 'spg', 'wd1', 'wd1pp', 'coupled_grpo', 'trace'),
  'rl.eval_split': ('test', 'valid'),
  'rl.reference_dtype': ('float32', 'bfloat16'),
  'model.attention_mask': ('bidirectional', 'causal', 'block_causal'),
  'model.attention_backend': ('xla', 'cudnn', 'pallas', 'auto'),
  'model.norm_backend': ('xla', 'pallas', 'auto'),
  'model.dtype': ('float32', 'bfloat16'),
  'model.router': ('softmax_topk', 'softmax_topk_raw', 'sigmoid_bias'),
  'model.moe_backend': ('auto', 'xla', 'tokamax', 'pallas'),
  'model.moe_exchange': ('gather', 'all_to_all'),
  'model.matmul_dtype': ('compute', 'fp8'),
  'model.remat': (
    'none',
    'minimal',
    'save_dots',
    'save_dots_attention',
    'save_activations',
    'full',
  ),
  'diffusion.objective': ('mdm', 'ar', 'block'),
  'diffusion.block_parameterization': ('subs', 'plain'),
  'data.source': ('builtin', 'megatron', 'tfds:NAME:SPLIT'),
  'train.schedule': ('wsd', 'wsd_linear', 'wsd_cosine', 'cosine', 'constant'),
  'sft.chat_template': ('none', 'plain', 'llada', 'chatml', 'dream'),
  'sft.too_long': ('truncate', 'drop', 'error'),
  'sampler.cache': ('none', 'truncate', 'prefix', 'dual', 'block'),
  'sampler.schedule': ('auto', 'linear', 'dream'),
}
LOG_OUTPUTS = ('tensorboard', 'wandb', 'plots')


def attention_streams(config) -> int:
  """Sequence copies a training step's layers run on per real token: 2 for the block-diffusion
  objective ([x_t || x_0]), else 1. FLOPs and MFU count real tokens with this factor."""
  return 2 if config.diffusion.objective == 'block' and config.stage != 'rl' else 1


def log_outputs(config) -> tuple[str, ...]:
  """The names in log.outputs."""
  return tuple(name.strip() for name in config.log.outputs.split(',') if name.strip())


def get_key(config, dotted):
  """config["a"]["b"] for "a.b"."""
  node = config
  for part in dotted.split('.'):
    node = node[part]
  return node


def validate(config, num_devices: int | None = None) -> None:
  """Raises ConfigError naming the key and the fix for a config that cannot work.

  With num_devices, a -1 mesh axis is checked as resolved for that many devices.
  """
  for key, choices in _CHOICES.items():
    value = get_key(config, key)
    if key == 'data.source' and value.startswith('tfds:'):
      if len(value.split(':')) != 3 or not all(value.split(':')[1:]):
        raise ConfigError(
          f'data.source={value!r} is not tfds:NAME:SPLIT; set e.g. '
          '--config.data.source=tfds:lm1b:train.'
        )
      continue
    if value not in choices:
      raise ConfigError(
        f'{key}={value!r} is not one of {choices}; set --config.{key}=<one of them>.'
      )

  for item in filter(None, (part.strip() for part in config.data.columns.split(','))):
    ours, _, theirs = item.partition('=')
    if not ours.strip() or not theirs.strip():
      raise ConfigError(
        f'data.columns item {item!r} is not OURS=THEIRS; set e.g. '
        "--config.data.columns='prompt=question,response=answer'."
      )

  m, t = config.model, config.train
  for key in (
    'num_layers',
    'd_model',
    'num_heads',
    'num_kv_heads',
    'head_dim',
    'ffn_dim',
    'vocab_size',
    'seq_len',
  ):
    if m[key] <= 0:
      raise ConfigError(f'model.{key}={m[key]} must be positive.')
  if m.num_heads % m.num_kv_heads:
    raise ConfigError(
      f'model.num_heads={m.num_heads} is not a multiple of model.num_kv_heads='
      f'{m.num_kv_heads}; grouped-query attention needs whole groups.'
    )
  if m.head_dim % 2:
    raise ConfigError(f'model.head_dim={m.head_dim} must be even for rotary embeddings.')
  parse_rope_scaling(m.rope_scaling)
  rope_dim = int(m.head_dim * m.rope_fraction)
  if not 0 < m.rope_fraction <= 1 or rope_dim < 2 or rope_dim % 2:
    raise ConfigError(
      f'model.rope_fraction={m.rope_fraction} must be in (0, 1] and rotate an even number of '
      f'dims of model.head_dim={m.head_dim} (int(head_dim x fraction) = {rope_dim}).'
    )
  if m.loss_chunk_tokens < 0:
    raise ConfigError(
      f'model.loss_chunk_tokens={m.loss_chunk_tokens} must be >= 0 (0 = full logits).'
    )
  for key in ('mask_token_id', 'eos_token_id', 'pad_token_id'):
    if not 0 <= m[key] < m.vocab_size:
      raise ConfigError(
        f'model.{key}={m[key]} is outside the vocabulary [0, {m.vocab_size}); '
        f"set it to the tokenizer's id."
      )
  if m.attention_mask == 'block_causal' and m.seq_len % m.block_size:
    raise ConfigError(
      f'model.seq_len={m.seq_len} is not a multiple of model.block_size='
      f'{m.block_size}; block-causal attention needs whole blocks.'
    )
  if m.attention_backend == 'cudnn' and m.attention_mask == 'block_causal':
    raise ConfigError(
      'model.attention_backend=cudnn cannot express block_causal masks without a '
      'dense mask; use --config.model.attention_backend=pallas (or auto, or xla).'
    )
  if config.data.packing and m.attention_backend == 'cudnn':
    raise ConfigError(
      'data.packing=True needs per-document attention, which the cudnn backend '
      'could only do with a dense mask; use '
      '--config.model.attention_backend=pallas (or auto), '
      '--config.model.attention_backend=xla or --config.data.packing=False.'
    )
  # Pallas flash attention (dlmjax/kernels/flash_attention.py): Triton tiles are powers of two.
  if m.attention_backend == 'pallas' and (m.head_dim < 16 or m.head_dim & (m.head_dim - 1)):
    raise ConfigError(
      f'model.attention_backend=pallas needs a power-of-two model.head_dim >= 16, '
      f'got {m.head_dim}; use --config.model.attention_backend=auto (or xla).'
    )
  if m.norm_backend == 'pallas':  # kernels/rms_norm.py: Triton tiles are powers of two.
    for key in ('d_model', 'head_dim', 'num_heads', 'num_kv_heads'):
      if m[key] & (m[key] - 1):
        raise ConfigError(
          f'model.norm_backend=pallas needs a power-of-two model.{key}, got '
          f'{m[key]}; use --config.model.norm_backend=auto (or xla).'
        )
  if config.diffusion.objective == 'ar' and m.attention_mask != 'causal':
    raise ConfigError('diffusion.objective=ar needs --config.model.attention_mask=causal.')
  if config.diffusion.objective == 'ar' and m.shift_logits:
    raise ConfigError(
      'diffusion.objective=ar already predicts the next token; model.shift_logits=True would '
      'shift it twice: set --config.model.shift_logits=false.'
    )
  if config.diffusion.objective == 'block' and m.attention_mask != 'block_causal':
    raise ConfigError(
      'diffusion.objective=block trains a block_causal model (it decodes block by block); '
      'set --config.model.attention_mask=block_causal.'
    )
  if config.diffusion.objective == 'block' and m.shift_logits:
    raise ConfigError(
      'diffusion.objective=block predicts each token at its own position (BD3LM, SDAR); set '
      '--config.model.shift_logits=false.'
    )
  if not 0.0 <= config.diffusion.varlen_prob <= 1.0:
    raise ConfigError(f'diffusion.varlen_prob={config.diffusion.varlen_prob} must be in [0, 1].')

  for key in ('steps', 'global_batch_size', 'micro_batch_size'):
    if t[key] <= 0:
      raise ConfigError(f'train.{key}={t[key]} must be positive.')
  if t.global_batch_size % t.micro_batch_size:
    raise ConfigError(
      f'train.global_batch_size={t.global_batch_size} is not a multiple of '
      f'train.micro_batch_size={t.micro_batch_size}; pick a micro-batch that '
      'divides it (gradients accumulate over global/micro steps).'
    )
  if _ramp_steps(t) > t.steps:
    raise ConfigError(
      f'train.warmup_steps + train.wsd_decay_steps = {_ramp_steps(t)} exceeds '
      f'train.steps={t.steps}; lower --config.train.warmup_steps and '
      '--config.train.wsd_decay_steps.'
    )
  if t.max_consecutive_skips < 0:
    raise ConfigError(f'train.max_consecutive_skips={t.max_consecutive_skips} must be >= 0.')
  if t.spike_factor < 0 or t.spike_window < 0 or 0 < t.spike_factor <= 1:
    raise ConfigError(
      f'train.spike_factor={t.spike_factor} must be 0 (off) or above 1, and '
      f'train.spike_window={t.spike_window} >= 0.'
    )
  if config.checkpoint.every < 0 or config.checkpoint.keep < 1:
    raise ConfigError('checkpoint.every must be >= 0 and checkpoint.keep >= 1.')
  for key in ('checkpoint.every_minutes', 'checkpoint.keep_every', 'train.max_minutes'):
    if get_key(config, key) < 0:
      raise ConfigError(f'{key}={get_key(config, key)} must be >= 0 (0 turns it off).')
  if config.log.every < 1:
    raise ConfigError(f'log.every={config.log.every} must be >= 1.')
  if config.eval.every < 0 or config.eval.batches < 1:
    raise ConfigError(
      f'eval.every={config.eval.every} must be >= 0 and eval.batches={config.eval.batches} >= 1.'
    )
  for name in log_outputs(config):
    if name not in LOG_OUTPUTS:
      raise ConfigError(
        f'log.outputs={config.log.outputs!r} names {name!r}; use a '
        f"comma-separated subset of {LOG_OUTPUTS} (or '' for none)."
      )

  _validate_sft(config)
  _validate_rl(config)
  _validate_lora(config)
  check_sampler_settings(config.sampler, prefix='sampler.')
  _check_sampler_model(config)
  _validate_mesh(config, num_devices)


def _check_sampler_model(config):
  """The sampler's cache against the model it decodes (the sampler's own checks, early)."""
  cache, m = config.sampler.cache, config.model
  if cache in ('truncate', 'block') and m.attention_mask == 'bidirectional':
    raise ConfigError(
      f'sampler.cache={cache} is exact only for causal or block_causal models, and '
      'model.attention_mask=bidirectional; use sampler.cache=none, prefix or dual.'
    )


LORA_BASE_DTYPES = ('bfloat16', 'float32', 'int8', 'nf4', 'int4')


def _validate_lora(config):
  """train.lora.*: adapters need a base to adapt and ranks the projections can hold."""
  lora, m = config.train.lora, config.model
  if lora.rank < 0:
    raise ConfigError(f'train.lora.rank={lora.rank} must be >= 0 (0 = full fine-tuning).')
  if lora.rank == 0:
    if lora.init_adapter:
      raise ConfigError(
        f'train.lora.init_adapter={lora.init_adapter!r} needs adapters: set '
        "--config.train.lora.rank (the adapter's own rank)."
      )
    return
  if not config.init_from:
    raise ConfigError(
      'train.lora.rank > 0 trains adapters on a frozen base model: set --config.init_from to '
      'a dlmjax run, step or Hugging Face directory (or train.lora.rank=0 to train every weight).'
    )
  if lora.base_dtype not in LORA_BASE_DTYPES:
    raise ConfigError(
      f'train.lora.base_dtype={lora.base_dtype!r} is not one of {LORA_BASE_DTYPES}.'
    )
  if lora.base_dtype in ('nf4', 'int4'):
    # 4-bit codes pack two per byte in blocks of 64 (or the whole axis, when shorter) along each
    # projection's last input axis: d_model, ffn_dim and head_dim (model/quantize.py).
    for key in ('d_model', 'ffn_dim', 'head_dim'):
      n = m[key]
      if n % 2 or (n > 64 and n % 64):
        raise ConfigError(
          f'train.lora.base_dtype={lora.base_dtype} stores blocks of 64 inputs: model.{key}={n} '
          'is not even and a multiple of 64 (or below 64); use base_dtype=int8 or bfloat16.'
        )
  if not 0 <= lora.dropout < 1:
    raise ConfigError(f'train.lora.dropout={lora.dropout} must be in [0, 1) (PEFT: 0.05).')
  if lora.dropout > 0 and config.mesh.pipeline > 1:
    raise ConfigError(
      f'train.lora.dropout={lora.dropout} draws its masks per layer of the whole stack, which '
      'the pipeline splits into stages: set --config.mesh.pipeline=1 or train.lora.dropout=0.'
    )
  if lora.alpha <= 0:
    raise ConfigError(f'train.lora.alpha={lora.alpha} must be positive.')
  names = lora_targets(config)
  widths = projection_widths(m)
  unknown = [t for t in names if t not in widths]
  if unknown or not names:
    raise ConfigError(
      f'train.lora.targets={lora.targets!r} names {unknown or "nothing"}; use a '
      f'comma-separated subset of {",".join(widths)}.'
    )
  for target in names:
    if lora.rank > min(widths[target]):
      raise ConfigError(
        f"train.lora.rank={lora.rank} exceeds the {target} projection's width "
        f'{min(widths[target])} ({widths[target][0]} -> {widths[target][1]}); lower '
        '--config.train.lora.rank or drop the target.'
      )


def dense_layers(m) -> tuple[int, ...]:
  """model.dense_layers as sorted layer indices ('3,0' -> (0, 3)); ConfigError if not integers."""
  text = m.dense_layers
  try:
    return tuple(sorted({int(part) for part in text.split(',') if part.strip()}))
  except ValueError:
    raise ConfigError(
      f'model.dense_layers={text!r} is not comma-separated layer indices; set e.g. '
      "--config.model.dense_layers='0,1'."
    ) from None


def dense_layer_indices(
  num_layers: int, *, sparse_step: int = 1, mlp_only=(), first_k_dense: int = 0
) -> str:
  """model.dense_layers of a checkpoint's layer pattern: transformers' Qwen3-MoE makes layer i
  sparse iff i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0; DeepSeek / Ling
  / LLaDA2 keep the first first_k_dense_replace layers dense."""
  if sparse_step < 1:
    raise ConfigError(f'decoder_sparse_step={sparse_step} must be >= 1.')
  dense = [
    i for i in range(num_layers) if i in set(mlp_only) or (i + 1) % sparse_step or i < first_k_dense
  ]
  return ','.join(map(str, dense))


def lora_targets(config) -> tuple[str, ...]:
  """The names in train.lora.targets ('q,k,v' -> ('q', 'k', 'v'))."""
  return tuple(t.strip() for t in config.train.lora.targets.split(',') if t.strip())


def projection_widths(m) -> dict[str, tuple[int, int]]:
  """(input, output) width of each LoRA target's projection (train.lora.targets) of a model
  group or ModelConfig (the same field names)."""
  d, f = m.d_model, m.ffn_dim
  q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
  return dict(q=(d, q), k=(d, kv), v=(d, kv), o=(q, d), gate=(d, f), up=(d, f), down=(f, d))


def _validate_rl(config):
  """Stage rl: the group, batch, sampler and prompt sizes must fit together."""
  r = config.rl
  if config.stage != 'rl':
    return
  if not config.init_from:
    raise ConfigError(
      'stage rl improves a trained (ideally fine-tuned) model: set '
      '--config.init_from to a dlmjax run or step directory.'
    )
  if r.group_size < 2:
    raise ConfigError(
      f'rl.group_size={r.group_size}: group advantages need at least 2 '
      'completions per prompt; set --config.rl.group_size=2 or more.'
    )
  if config.train.global_batch_size % r.group_size:
    raise ConfigError(
      f'rl.group_size={r.group_size} does not divide train.global_batch_size='
      f'{config.train.global_batch_size}; each rollout holds whole groups.'
    )
  for key in ('num_prompts', 'max_prompt_tokens', 'inner_updates', 'elbo_samples'):
    if r[key] < 1:
      raise ConfigError(f'rl.{key}={r[key]} must be >= 1.')
  gen_length = config.sampler.gen_length
  if r.max_prompt_tokens + gen_length > config.model.seq_len:
    raise ConfigError(
      f'rl.max_prompt_tokens + sampler.gen_length = '
      f'{r.max_prompt_tokens + gen_length} exceed model.seq_len='
      f'{config.model.seq_len}; shorten them.'
    )
  if r.kl_beta < 0 or not 0 < r.clip_eps or not 0 <= r.p_mask_prompt <= 1:
    raise ConfigError('rl.kl_beta must be >= 0, rl.clip_eps > 0 and rl.p_mask_prompt in [0, 1].')
  if r.objective in ('spg', 'wd1', 'wd1pp') and r.kl_beta > 0:
    raise ConfigError(
      f'rl.objective={r.objective} has no KL term (it trains without a reference), but '
      f'rl.kl_beta={r.kl_beta}; set --config.rl.kl_beta=0.'
    )
  if r.ref_sync_every < 0 or not 0 < r.ref_sync_alpha <= 1:
    raise ConfigError(
      f'rl.ref_sync_every={r.ref_sync_every} must be >= 0 (0 = never) and '
      f'rl.ref_sync_alpha={r.ref_sync_alpha} in (0, 1].'
    )
  if r.ref_sync_every and r.kl_beta == 0:
    raise ConfigError(
      f'rl.ref_sync_every={r.ref_sync_every} refreshes the KL reference, but rl.objective='
      f'{r.objective} with rl.kl_beta=0 has no KL term; set --config.rl.ref_sync_every=0.'
    )
  if r.ref_sync_every and (config.train.lora.rank > 0 or r.reference_on_host):
    raise ConfigError(
      f'rl.ref_sync_every={r.ref_sync_every} keeps a refreshed reference in the train state, '
      'on the mesh and for a full fine-tune (with LoRA the reference is the frozen base, as in '
      'd1 under PEFT); set --config.rl.ref_sync_every=0, or train.lora.rank=0 and '
      'rl.reference_on_host=False.'
    )
  m = config.model
  if r.objective == 'trace' and (
    m.attention_mask != 'block_causal'
    or m.shift_logits
    or config.sampler.block_length != m.block_size
  ):
    raise ConfigError(
      'rl.objective=trace scores each token in the state the sampler committed it in, one model '
      'block at a time: set --config.model.attention_mask=block_causal, model.shift_logits=false '
      f'and sampler.block_length=model.block_size ({m.block_size}).'
    )
  if r.objective == 'wd1pp':
    _validate_wd1pp(config)
  if r.objective == 'spg':
    if not 0 <= r.spg_mix_weight <= 1 or r.spg_eubo_beta < 1:
      raise ConfigError(
        f'rl.spg_mix_weight={r.spg_mix_weight} must be in [0, 1] and '
        f'rl.spg_eubo_beta={r.spg_eubo_beta} >= 1 (the EUBO is a bound for '
        'beta >= 1).'
      )


def _validate_wd1pp(config):
  """wd1++ reads every step's whole-canvas prediction: the uncached sampler on a model without
  the block grid, every step committing a token (so every row runs all sampler.steps steps)."""
  s, r = config.sampler, config.rl
  if s.cache != 'none':
    raise ConfigError(
      f"rl.objective=wd1pp needs every step's whole-canvas prediction, which sampler.cache="
      f'{s.cache} does not compute: set --config.sampler.cache=none.'
    )
  if config.model.attention_mask == 'block_causal':
    raise ConfigError(
      'rl.objective=wd1pp needs a model without the block grid (its canvas can run an extra '
      'block): set model.attention_mask to bidirectional or causal.'
    )
  if s.threshold > 0 or s.factor > 0 or s.stop_at_eos or s.steps > s.gen_length:
    raise ConfigError(
      'rl.objective=wd1pp needs every sampler step to commit a token: set sampler.threshold=0, '
      'sampler.factor=0, sampler.stop_at_eos=False and sampler.steps <= sampler.gen_length.'
    )
  if not r.wd1pp_psi > 0:
    raise ConfigError(f'rl.wd1pp_psi={r.wd1pp_psi} must be > 0.')


# The sampler's decoding orders (dlmjax/diffusion/decoding.py); Dream's names that differ.
SAMPLER_ORDERS = ('low_confidence', 'random', 'entropy', 'margin', 'maskgit_plus')
SAMPLER_SCHEDULES = ('auto', 'linear', 'dream')  # diffusion/schedules.py
_DREAM_ORDERS = {'topk_margin': 'margin', 'origin': 'random'}


def check_sampler_settings(settings, prefix: str = '') -> None:
  """The sampler's rules, written once: for the sampler.* group (prefix 'sampler.') and for any
  dlmjax.diffusion.sampler.SamplingConfig (its validate); raises ConfigError naming the setting."""
  p = prefix
  for key in ('gen_length', 'steps', 'block_length'):
    value = getattr(settings, key)
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
      raise ConfigError(f'{p}{key}={value!r} must be a positive integer.')
  gen, block, steps = settings.gen_length, settings.block_length, settings.steps
  if gen % block:
    raise ConfigError(
      f'{p}gen_length={gen} is not a multiple of {p}block_length={block}; pick a block_length '
      'that divides it.'
    )
  if steps % (gen // block):
    raise ConfigError(
      f'{p}steps={steps} is not a multiple of the {gen // block} blocks ({p}gen_length / '
      f'{p}block_length); use steps = k * {gen // block}.'
    )
  if settings.temperature < 0:
    raise ConfigError(f'{p}temperature={settings.temperature} must be >= 0 (0 = greedy).')
  if not 0 < settings.top_p <= 1:
    raise ConfigError(f'{p}top_p={settings.top_p} must lie in (0, 1].')
  if settings.cfg_scale < 0:
    raise ConfigError(f'{p}cfg_scale={settings.cfg_scale} must be >= 0 (0 = off).')
  if not 0 <= settings.threshold <= 1:
    raise ConfigError(f'{p}threshold={settings.threshold} must lie in [0, 1] (0 = off).')
  order = settings.remasking
  if order not in SAMPLER_ORDERS:
    hint = (
      f" (Dream's {order} is closest to {_DREAM_ORDERS[order]!r})" if order in _DREAM_ORDERS else ''
    )
    raise ConfigError(
      f'{p}remasking={order!r} is not a decoding order{hint}; use one of {SAMPLER_ORDERS}.'
    )
  if not settings.alg_temp >= 0:
    raise ConfigError(
      f'{p}alg_temp={settings.alg_temp} must be >= 0 (0 = the most confident, > 0 = drawn).'
    )
  if not settings.factor >= 0:
    raise ConfigError(f'{p}factor={settings.factor} must be >= 0 (0 = off; Fast-dLLM uses 1).')
  if settings.threshold > 0 and settings.factor > 0:
    raise ConfigError(
      f'{p}threshold={settings.threshold} and {p}factor={settings.factor} are two alternative '
      'rules of Fast-dLLM; set one of them to 0.'
    )
  if order == 'entropy' and (settings.threshold > 0 or settings.factor > 0):
    raise ConfigError(
      f'{p}threshold and {p}factor bound a probability, but {p}remasking=entropy scores a '
      'negative entropy; use remasking low_confidence, maskgit_plus or margin with them.'
    )
  if settings.schedule not in SAMPLER_SCHEDULES:
    raise ConfigError(
      f'{p}schedule={settings.schedule!r} is not a schedule; use one of {SAMPLER_SCHEDULES}.'
    )
  if not 0 < settings.eps < 1:
    raise ConfigError(f"{p}eps={settings.eps} must lie in (0, 1) (Dream's default 1e-3).")
  refresh, spb = settings.cache_refresh, steps // (gen // block)
  if not isinstance(refresh, numbers.Integral) or refresh < 0 or (refresh and spb % refresh):
    raise ConfigError(
      f'{p}cache_refresh={refresh!r} must be 0 (refresh at block start only) or divide the '
      f'{spb} steps per block ({p}steps / blocks); pick a divisor of {spb}.'
    )


def _validate_sft(config):
  s = config.sft
  if config.stage == 'sft' and not config.init_from:
    raise ConfigError(
      'stage sft fine-tunes a trained model: set --config.init_from to a dlmjax '
      'run or step directory or a Hugging Face directory.'
    )
  if config.stage == 'sft' and not s.train_file and config.data.source != 'builtin':
    raise ConfigError(
      'stage sft reads sft.train_file (jsonl), or the built-in instruction set '
      'when data.source=builtin; set --config.sft.train_file=PATH.'
    )


def _ramp_steps(t) -> int:
  """Steps the schedule spends warming up plus, for wsd*, annealing."""
  return t.warmup_steps + (t.wsd_decay_steps if t.schedule.startswith('wsd') else 0)


def fit_schedule(config) -> str | None:
  """Shrinks warmup and anneal in proportion when they do not fit in train.steps (a shortened
  run, e.g. --config.train.steps=5); returns the one info line to print, or None."""
  t = config.train
  ramp = _ramp_steps(t)
  if t.steps <= 0 or ramp <= t.steps:
    return None
  wsd = t.schedule.startswith('wsd')
  before = f'warmup {t.warmup_steps}' + (f' + anneal {t.wsd_decay_steps}' if wsd else '')
  t.warmup_steps = t.warmup_steps * t.steps // ramp
  if wsd:
    t.wsd_decay_steps = t.wsd_decay_steps * t.steps // ramp
  after = f'warmup {t.warmup_steps}' + (f' + anneal {t.wsd_decay_steps}' if wsd else '')
  overrides = '--config.train.warmup_steps' + (' / --config.train.wsd_decay_steps' if wsd else '')
  return (
    f'train.steps={t.steps} is shorter than {before} steps: scaled to {after} (set '
    f'{overrides} to choose).'
  )


def fit_to_devices(config, num_devices: int) -> None:
  """Validates the config for num_devices, then resolves a -1 mesh axis in place."""
  validate(config, num_devices=num_devices)
  resolve_mesh(config, num_devices)


def _validate_mesh(config, num_devices):
  m = config.model
  tensor = config.mesh.tensor
  for key in ('num_heads', 'num_kv_heads', 'ffn_dim'):
    if tensor > 0 and m[key] % tensor:
      raise ConfigError(
        f'model.{key}={m[key]} is not divisible by mesh.tensor={tensor}; '
        'pick a tensor size that divides it.'
      )
  # Check a resolved copy: with a device count a -1 axis takes its size, without one it counts 1.
  config = ml_collections.ConfigDict(config.to_dict())
  if num_devices is None:
    for axis in MESH_AXES:
      config.mesh[axis] = max(config.mesh[axis], 1)
  else:
    resolve_mesh(config, num_devices)
  mesh = config.mesh
  for axis in MESH_AXES:
    if mesh[axis] < 1:
      raise ConfigError(f'mesh.{axis}={mesh[axis]} must be >= 1 (or -1 to fill the devices).')
  _validate_pipeline_and_context(config)
  _validate_experts(config)
  for key in ('num_heads', 'num_kv_heads', 'ffn_dim'):
    if m[key] % mesh.tensor:
      raise ConfigError(
        f'model.{key}={m[key]} is not divisible by mesh.tensor={mesh.tensor}; '
        'pick a tensor size that divides it.'
      )
  if padded_vocab_size(config) % mesh.tensor:
    raise ConfigError(
      f'the padded vocabulary ({padded_vocab_size(config)} rows, model.vocab_size rounded up to '
      f'{VOCAB_MULTIPLE}) is not divisible by mesh.tensor={mesh.tensor}; use a power-of-two '
      'tensor size.'
    )
  if m.d_model % (mesh.fsdp * mesh.context):
    raise ConfigError(
      f'model.d_model={m.d_model} is not divisible by mesh.fsdp x mesh.context = '
      f'{mesh.fsdp * mesh.context} (weights are sharded over both).'
    )
  total = mesh_size(config)
  if num_devices is not None and total > num_devices:
    raise ConfigError(
      f'the mesh needs {total} devices (data {mesh.data} x fsdp {mesh.fsdp} x '
      f'expert {mesh.expert} x tensor {mesh.tensor} x pipeline {mesh.pipeline} x context '
      f'{mesh.context}) but only {num_devices} '
      'exist; shrink the mesh axes.'
    )
  if num_devices is not None and total < num_devices:
    raise ConfigError(
      f'the mesh uses {total} of {num_devices} devices; make data x fsdp x expert x tensor '
      f'x pipeline x context = {num_devices}, or set one axis to -1 to fill '
      'them.'
    )
  dp = batch_parallelism(config)
  if config.train.micro_batch_size % dp:
    raise ConfigError(
      f'train.micro_batch_size={config.train.micro_batch_size} is not divisible by '
      f'the batch-parallel devices mesh.data x mesh.fsdp x mesh.expert = {dp}; set '
      f'--config.train.micro_batch_size to a multiple of {dp}.'
    )


def _validate_experts(config):
  """The MoE keys (on a resolved mesh)."""
  m, mesh, t = config.model, config.mesh, config.train
  if m.num_experts < 0 or m.moe_ffn_dim < 0 or m.shared_experts < 0:
    raise ConfigError(
      'model.num_experts, model.moe_ffn_dim and model.shared_experts must be >= 0 (0 = dense, '
      'ffn_dim, none).'
    )
  for key in ('moe_balance_loss', 'moe_z_loss', 'moe_bias_rate'):
    if t[key] < 0:
      raise ConfigError(f'train.{key}={t[key]} must be >= 0 (0 = off).')
  dense = dense_layers(m)
  if dense and not m.num_experts:
    raise ConfigError(
      f'model.dense_layers={m.dense_layers!r} marks dense layers of an MoE model, but '
      "model.num_experts=0 (every layer is dense); set --config.model.dense_layers=''."
    )
  outside = [i for i in dense if not 0 <= i < m.num_layers]
  if outside:
    raise ConfigError(
      f'model.dense_layers={m.dense_layers!r} names layers {outside} outside [0, '
      f'model.num_layers={m.num_layers}); list indices below {m.num_layers}.'
    )
  if dense and len(dense) == m.num_layers:
    raise ConfigError(
      f'model.dense_layers={m.dense_layers!r} makes every layer dense; set '
      "--config.model.num_experts=0 and --config.model.dense_layers=''."
    )
  if not m.num_experts:
    if mesh.expert > 1:
      raise ConfigError(
        f'mesh.expert={mesh.expert} splits MoE experts but model.num_experts=0; set '
        '--config.mesh.expert=1 or give the model experts.'
      )
    return
  if not 0 < m.experts_per_token <= m.num_experts:
    raise ConfigError(
      f'model.experts_per_token={m.experts_per_token} must be in [1, model.num_experts='
      f'{m.num_experts}]; set --config.model.experts_per_token to at most {m.num_experts}.'
    )
  _validate_router_groups(m)
  if m.num_experts % mesh.expert:
    raise ConfigError(
      f'model.num_experts={m.num_experts} is not divisible by mesh.expert={mesh.expert}; pick an '
      'expert size that divides it.'
    )
  if (m.moe_ffn_dim or m.ffn_dim) % mesh.tensor:
    raise ConfigError(
      f'the expert width (model.moe_ffn_dim or model.ffn_dim) is not divisible by mesh.tensor='
      f'{mesh.tensor}; pick a tensor size that divides it.'
    )
  if dense and mesh.pipeline > 1:
    raise ConfigError(
      f'pipeline stages split one stack of identical layers, but model.dense_layers='
      f'{m.dense_layers!r} mixes dense and MoE layers; set --config.mesh.pipeline=1.'
    )
  if m.matmul_dtype != 'compute':
    raise ConfigError(
      f'model.matmul_dtype={m.matmul_dtype} does not cover the MoE experts; set '
      '--config.model.matmul_dtype=compute.'
    )


def _validate_router_groups(m):
  """model.router_groups / router_group_topk / routed_scale of an MoE model."""
  groups, topk = m.router_groups, m.router_group_topk
  if groups < 1 or m.num_experts % groups or not 1 <= topk <= groups:
    raise ConfigError(
      f'model.router_groups={groups} must divide model.num_experts={m.num_experts} and '
      f'model.router_group_topk={topk} be in [1, router_groups].'
    )
  if groups > 1 and m.router != 'sigmoid_bias':
    raise ConfigError(
      f'model.router_groups={groups} limits the sigmoid_bias router only; set '
      '--config.model.router=sigmoid_bias or --config.model.router_groups=1.'
    )
  if m.experts_per_token > topk * (m.num_experts // groups):
    raise ConfigError(
      f'model.experts_per_token={m.experts_per_token} exceeds the {topk} x '
      f'{m.num_experts // groups} experts of the kept groups; raise model.router_group_topk.'
    )
  if not m.routed_scale > 0:
    raise ConfigError(f'model.routed_scale={m.routed_scale} must be > 0 (1 = unscaled).')


def _validate_pipeline_and_context(config):
  """Divisibility the pipeline schedule and the sequence split need (on a resolved mesh)."""
  m, mesh = config.model, config.mesh
  if mesh.pipeline_repeats < 1 or mesh.pipeline_microbatches < 0:
    raise ConfigError(
      f'mesh.pipeline_repeats={mesh.pipeline_repeats} must be >= 1 and '
      f'mesh.pipeline_microbatches={mesh.pipeline_microbatches} >= 0 (0 = one per '
      'stage).'
    )
  if mesh.pipeline > 1:
    stages, repeats = mesh.pipeline, mesh.pipeline_repeats
    micro = pipeline_microbatches(config)
    if m.num_layers % (stages * repeats):
      raise ConfigError(
        f'model.num_layers={m.num_layers} is not divisible by mesh.pipeline x '
        f'mesh.pipeline_repeats = {stages} x {repeats}; every stage needs the '
        'same number of layers per repeat.'
      )
    if repeats > 1 and micro < stages:
      raise ConfigError(
        f'the circular pipeline (mesh.pipeline_repeats={repeats}) needs '
        f'mesh.pipeline_microbatches >= mesh.pipeline={stages}, got {micro}.'
      )
    rows = micro * batch_parallelism(config)
    if config.train.micro_batch_size % rows:
      raise ConfigError(
        f'train.micro_batch_size={config.train.micro_batch_size} does not split '
        f'into {micro} pipeline micro-batches over mesh.data x mesh.fsdp x mesh.expert = '
        f'{batch_parallelism(config)} devices; make it a multiple of {rows} or '
        'change mesh.pipeline_microbatches.'
      )
  if mesh.context > 1:
    if m.seq_len % mesh.context:
      raise ConfigError(
        f'model.seq_len={m.seq_len} is not divisible by mesh.context='
        f'{mesh.context}; every device holds an equal slice of the sequence.'
      )
    heads = mesh.tensor * mesh.context
    for key in ('num_heads', 'num_kv_heads'):
      if m[key] % heads:
        raise ConfigError(
          f'model.{key}={m[key]} is not divisible by mesh.tensor x mesh.context '
          f'= {heads}: context-parallel attention splits the heads over both; '
          'lower mesh.context or mesh.tensor.'
        )
