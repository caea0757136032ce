"""Every key with its default and meaning, and which keys are the architecture.

configs/*.py start from `defaults()` and set only what differs; code reads keys directly (never
`config.get(key, default)`), so an unknown override fails at parse time.
"""

from __future__ import annotations

import ml_collections


def defaults() -> ml_collections.ConfigDict:
  """Every key with its default; the meaning of each beside it (docs by topic in README.md)."""
  c = ml_collections.ConfigDict()
  c.stage = 'pretrain'  # pretrain | sft | rl | preference | reward: the batch source and loss.
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
  # Mixture of experts (dlmjax/model/moe.py, docs/moe.md), one group: num_experts > 0 makes each
  # layer's MLP an MoE of that many SwiGLU experts of width ffn_dim (0 = model.ffn_dim),
  # experts_per_token chosen per token by the router: softmax_topk (weights renormalised,
  # Qwen3-MoE) | softmax_topk_raw (raw softmax weights, LLaDA-MoE / OLMoE) | sigmoid_bias
  # (DeepSeek-V3 loss-free balancing); shared_experts > 0 adds a dense SwiGLU of shared_experts x
  # ffn_dim every token passes. dense_layers: comma-separated layer indices ('0,1') whose MLP stays
  # the dense one of model.ffn_dim (Qwen3-MoE's mlp_only_layers / decoder_sparse_step, DeepSeek's
  # first_k_dense_replace; dense_layer_indices derives it); '' = every layer MoE.
  c.model.moe = ml_collections.ConfigDict()
  c.model.moe.num_experts = 0  # 0 = the dense MLP
  c.model.moe.dense_layers = ''  # layers kept dense ('' = none)
  c.model.moe.experts_per_token = 2  # k
  c.model.moe.ffn_dim = 0  # each expert's width
  c.model.moe.shared_experts = 0  # always-on experts
  c.model.moe.router = 'softmax_topk'  # softmax_topk | softmax_topk_raw | sigmoid_bias
  # Group-limited routing (sigmoid_bias only; DeepSeek-V3's n_group / topk_group, LLaDA2's): the
  # experts form router_groups equal groups, each scored by the sum of its two best biased
  # scores, and a token's experts_per_token are chosen among its router_group_topk best groups
  # (1 / 1: no grouping). routed_scale multiplies the routed experts' weights
  # (routed_scaling_factor; the shared experts' output is not scaled).
  c.model.moe.router_groups = 1
  c.model.moe.router_group_topk = 1
  c.model.moe.routed_scale = 1.0
  # Block routing (LLaDA2.2; model/moe.py): > 0 gives each diffusion block of model.block_size
  # positions a pool of this many experts, the best by their best score over the block's tokens,
  # and each token routes its top-k inside the pool (0 = per-token routing; LLaDA2.2: 48 of 256).
  c.model.moe.block_experts = 0
  # The experts' grouped matmul (kernels/grouped_matmul.py): xla (ragged_dot) | tokamax | pallas
  # (our Triton kernels) | auto (pallas on GPU, measured fastest: docs/benchmarks.md MoE; else xla).
  c.model.moe.backend = 'auto'
  # How tokens reach experts split over mesh.expert (model/moe.py): gather (all-gather the expert
  # group's tokens, reduce-scatter the outputs: 2 x expert x local activations per layer) |
  # all_to_all (send each assignment to its expert's device and back: dropless, so a dense
  # worst-case buffer of min(k, experts per device) times that; equal with one expert a device).
  c.model.moe.exchange = 'gather'
  # Router losses added to the training objective (0 = off): the load-balancing loss (k at
  # perfect balance) and the router z-loss, each times its coefficient; bias_rate: the
  # sigmoid_bias router's per-step bias update (DeepSeek-V3's gamma).
  c.model.moe.balance_loss = 0.0
  c.model.moe.z_loss = 0.0
  c.model.moe.bias_rate = 0.001
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
  # Expert parallelism: the MoE experts are split over mesh.expert devices (model.moe.num_experts a
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

  # Supervised fine-tuning (stage sft): LLaDA's recipe (dlmjax/train/sft_rows.py,
  # diffusion/sft_loss.py).
  c.sft = ml_collections.ConfigDict()
  # jsonl rows {"prompt", "response"} or {"messages": [{"role", "content"}, ...]}; '' with
  # data.source=builtin: the built-in instruction set made from dlmjax.tasks (no download).
  c.sft.train_file = ''
  c.sft.eval_file = ''  # held-out jsonl for val_loss (eval.every); builtin: the tasks' test split
  c.sft.chat_template = 'plain'  # none | plain | llada | chatml | dream (dlmjax/data/chat.py)
  c.sft.too_long = 'drop'  # rows longer than model.seq_len: truncate | drop | error
  # Distillation (README "Distillation", dlmjax/diffusion/distill/): certainty (dParallel) |
  # trajectory (d3LLM) trains on the frozen teacher's rows in sft.teacher_file (written by
  # `python -m dlmjax.distill`) instead of sft.train_file; llada is the plain SFT loss. The
  # active block is sampler.block_length tokens (the block the student decodes; both papers' 32),
  # the certainty entropy's temperature both papers' 0.5 (distill/base.py CERTAINTY_TEMPERATURE).
  c.sft.objective = 'llada'
  c.sft.teacher_file = ''  # .npz of tokens, roles, commit_steps [rows, model.seq_len + 1]
  c.sft.certainty_weight = 2.0  # beta of the certainty term: LLaDA's 2 in both papers (Dream: 1)

  # Preference alignment (stage preference, docs/preference.md): VRPO, LLaDA 1.5's DPO over
  # ELBO estimates (dlmjax/rl/vrpo.py; pairs: dlmjax/train/preference_rows.py; the stage:
  # dlmjax/train/stages/preference.py, its checks: dlmjax/train/config_checks.py). The reference
  # is RL's (rl.reference_dtype, rl.reference_on_host; LoRA: the base with the adapters off).
  c.preference = ml_collections.ConfigDict()
  # jsonl/parquet/hub:NAME rows {"prompt", "chosen", "rejected"} (strings), or chosen / rejected
  # as message lists (UltraFeedback); data.columns renames. builtin[:KIND], or '' with
  # data.source=builtin: the built-in pairs made from dlmjax.tasks (chosen: a worked solution;
  # rejected, by KIND: 'other' another problem's solution, 'near_miss' its own with a wrong answer).
  c.preference.train_file = ''
  c.preference.eval_file = ''  # held-out pairs (eval.every); builtin: the tasks' test split
  c.preference.beta = 0.1  # DPO's beta on the ELBO differences
  c.preference.budget = 8  # n = n_time x n_mask masked forwards per ELBO (policy and reference)
  # timesteps per ELBO: 0 = VRPO's optimal allocation (n_time = budget, n_mask = 1); K: K
  # timesteps with budget / K masks each
  c.preference.n_time = 0
  c.preference.antithetic = True  # reference scored with the policy's timesteps and masks

  # Evaluation (README, "Evaluation"; dlmjax/train/evaluation.py): the stage's loss on the
  # held-out ('valid') split, logged as val_loss / val_masked_ce, with masks from a fixed seed and
  # the example index, never the step, so every evaluation of a run scores the same tokens masked
  # the same way. Stage rl instead decodes rl.task's problems (rl.eval_split) greedily with the
  # rollout sampler and logs val_reward / val_accuracy (eval.batches x train.global_batch_size
  # problems).
  c.eval = ml_collections.ConfigDict()
  c.eval.every = 0  # steps between evaluations (and at the last step); 0 turns them off.
  c.eval.batches = 4  # global batches of the valid split per evaluation.

  # The masked-diffusion sampler (dlmjax/diffusion/sampling_config.py, SamplingConfig.from_config):
  # RL's rollouts and held-out decoding (at temperature 0) read it. generate, evaluate and the
  # lm-eval adapter take the same settings as flags / model_args, defaulting to LLaDA's demo.
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
  # > 0: also commit every masked token whose entropy is <= this (dParallel's decoding of a
  # certainty-distilled model, with remasking=entropy: 0.5; README "Distillation").
  c.sampler.entropy_threshold = 0.0
  # LLaDA2.1's token-to-token editing (diffusion/decoding.py): > 0 replaces a committed token of
  # the current block by the model's argmax v where v differs and p(v) > edit_threshold (0 = off);
  # a block then takes up to edit_steps edit-only steps after its masks are filled, stopping at
  # one that changes nothing. The Q / S modes: sampler_settings.LLADA21_MODES.
  c.sampler.edit_threshold = 0.0
  c.sampler.edit_steps = 16
  # > 0: d3LLM's entropy-based multi-block decoding (dlmjax/diffusion/multi_block.py, cache
  # none): the next block opens once the last is this decoded (d3LLM: 0.1); tokens commit by
  # entropy_threshold (d3LLM: 0.5).
  c.sampler.block_add_threshold = 0.0
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
  # A learned reward: a reward run's directory (stage reward, configs/reward.py) whose scores of
  # the completions are the rewards, in place of rl.task's (which still gives rollout_accuracy
  # and the held-out val_reward); '' = rl.task's reward. docs/preference.md.
  c.rl.reward_model = ''
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
  # MoE: whether RL's objective gets the router losses of model.moe.balance_loss / z_loss.
  c.rl.router_losses = False
  return c


# The keys that fix the parameters' shapes: init_from needs them equal, and so does a resume.
ARCHITECTURE_KEYS = (
  'model.num_layers',
  'model.d_model',
  'model.num_heads',
  'model.num_kv_heads',
  'model.head_dim',
  'model.ffn_dim',
  'model.vocab_size',
  'model.tie_embeddings',
  'model.qk_norm',
  'model.qkv_bias',
  'model.shift_logits',
  'model.moe.num_experts',
  'model.moe.experts_per_token',
  'model.moe.ffn_dim',
  'model.moe.shared_experts',
  'model.moe.router',
  'model.moe.dense_layers',
)
# The model group's keys under the model's own field names (ModelConfig, the presets, the
# Hugging Face readers): the MoE subgroup's keys; every other field is model.<its name>.
MODEL_FIELD_KEYS = {
  'num_experts': 'moe.num_experts',
  'experts_per_token': 'moe.experts_per_token',
  'moe_ffn_dim': 'moe.ffn_dim',
  'shared_experts': 'moe.shared_experts',
  'router': 'moe.router',
  'dense_layers': 'moe.dense_layers',
  'moe_backend': 'moe.backend',
  'moe_exchange': 'moe.exchange',
  'router_groups': 'moe.router_groups',
  'router_group_topk': 'moe.router_group_topk',
  'routed_scale': 'moe.routed_scale',
  'block_experts': 'moe.block_experts',
}
# The keys that fix the sample and mask streams: a resume needs them equal too (run-time knobs,
# backends, remat and the mesh may change).
STREAM_KEYS = ('seed', 'train.global_batch_size', 'diffusion.objective')

# Held-out masks and RL's held-out problems come from this seed and each example's index, so every
# evaluation of every run scores the same tokens masked the same way (dlmjax/train/evaluation.py).
EVAL_SEED = 0
# The embedding's rows are a multiple of this, whatever the mesh: a checkpoint's shapes must not
# depend on the layout it was trained on (docs/faults.md, "Mesh change on resume"). Megatron pads to
# 128 x tensor; 128 is divisible by every power-of-two tensor size up to 128.
VOCAB_MULTIPLE = 128
