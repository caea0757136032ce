"""The one map between dlmjax's parameter dict and Hugging Face tensor names and layouts.

Ours: one array per parameter kind stacked over layers (leading axis L; an MoE model with dense
layers stacks each run of layers of one kind under its own key, ModelConfig.layer_runs, and
layer i's tensors come from its run's slice), attention kernels split
by head ([D, N, H], [N, H, D]), matmul kernels as [in, out]. Hugging Face: one tensor per layer,
nn.Linear weights as [out, in]. Both directions stream: export yields one HF tensor at a time;
import fills each stacked array from one HF tensor at a time, so a model is never held twice.

Exports use the names of the layout asked for (hf_layouts; by default the family of the model's
options, hf_config.export_family: Qwen3 with QK-norm, Qwen2 with q/k/v biases, Llama with
neither). Imports read the names of every architecture in
hf_config.ARCHITECTURES into a model with the same options (model.qk_norm, model.qkv_bias); what a
checkpoint has that our model cannot express (a non-zero bias it has no slot for, a missing QK-norm)
is refused with the reason, never silently dropped.

This module is the entry point callers import; the code lives in three modules of one concept
each: hf_slots (our per-layer slots, the shapes on both sides, the layout transforms, the family
names), hf_export (params -> tensors) and hf_import (tensors -> params, with the checks that
refuse what our model cannot hold).
"""

from dlmjax.checkpoint.hf_export import export_entries, export_family, export_tensors
from dlmjax.checkpoint.hf_import import MISSING_QK_NORM, DictSource, check_source, import_params
from dlmjax.checkpoint.hf_slots import (
  NAMINGS,
  SCORE,
  MappingError,
  Naming,
  layer_slots,
  model_slots,
)

__all__ = [
  'MISSING_QK_NORM',
  'NAMINGS',
  'SCORE',
  'DictSource',
  'MappingError',
  'Naming',
  'check_source',
  'export_entries',
  'export_family',
  'export_tensors',
  'import_params',
  'layer_slots',
  'model_slots',
]
