"""Planning: memory, time, cost and the best parallel layout, from the config alone.

Nothing here imports torch. Modules:
  hardware  Device, CATALOGUE, load_devices(extra_toml), get_device, parse_cluster -> Cluster,
            Calibration (H100_CALIBRATION: the step-time model's constants and their source)
  layout    Layout (the parallel layout a plan is for), planned_loss_chunk
  memory    estimate_memory(model_cfg, layout, optimizer, seq_len, weights=...) -> MemoryBreakdown
            in one of CONVENTIONS: "lmforge" (what lmforge allocates), "megatron" (Megatron-LM's
            estimator: 18 B/param, its activation formula), "zero-paper" (the ZeRO paper's 16 B/param);
            its parts: conventions, params (param_specs), model_states (model_state_bytes_per_param),
            activations (activation_bytes_per_layer), loss_memory, buffers, documents (the document
            mask of data.attention = "document": its memory and attention time by kernel)
  op_time   op_times: one rank's step per op kind (matmul, attention, elementwise, loss, casts,
            optimizer, host gaps), the constants from hardware's Calibration (fitted on an H100)
  flops     flops_per_token, estimate_step -> StepEstimate (op times + bubble + communication; MFU
            and HFU), pipeline_bubble, simple_training_estimate, config_train_tokens
  micro_batch  choose_micro_batch: train.micro_batch_size = "auto" (the largest that fits)
  search    search_layouts(model_cfg, cluster, global_batch, seq_len, ...) -> SearchResult of Candidate
  report    terminal tables and JSON
(`lmforge plan ...` is lmforge/cli/plan.py, above the planner.)
"""

from lmforge.plan.flops import (StepEstimate, config_train_tokens, estimate_step, flops_per_token, pipeline_bubble,
                                simple_training_estimate)
from lmforge.plan.hardware import CATALOGUE, Cluster, Device, get_device, load_devices, parse_cluster
from lmforge.plan.memory import (CONVENTIONS, Layout, MemoryBreakdown, activation_bytes_per_layer, estimate_memory,
                                 model_state_bytes_per_param, param_specs)
from lmforge.plan.search import Candidate, SearchResult, search_layouts

__all__ = [
    "CATALOGUE", "CONVENTIONS", "Candidate", "Cluster", "Device", "Layout", "MemoryBreakdown", "SearchResult",
    "StepEstimate", "activation_bytes_per_layer", "config_train_tokens", "estimate_memory", "estimate_step",
    "flops_per_token", "get_device", "load_devices", "model_state_bytes_per_param", "param_specs", "parse_cluster",
    "pipeline_bubble", "search_layouts", "simple_training_estimate",
]
