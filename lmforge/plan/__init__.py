"""Planning: memory, time, cost and the best parallel layout, from the config alone.

Nothing here imports torch. Modules:
  hardware  Device, CATALOGUE, load_devices(extra_toml), get_device, parse_cluster -> Cluster
  memory    Layout, estimate_memory(model_cfg, layout, optimizer, seq_len, weights=...) -> MemoryBreakdown,
            model_state_bytes_per_param, activation_bytes_per_layer, param_specs
  flops     flops_per_token, estimate_step -> StepEstimate, pipeline_bubble, simple_training_estimate
  search    search_layouts(model_cfg, cluster, global_batch, seq_len, ...) -> list[Candidate]
  report    terminal tables and JSON
  cli_plan  plan_main(argv) -> int   (`lmforge plan ...`)
"""

from lmforge.plan.flops import StepEstimate, estimate_step, flops_per_token, pipeline_bubble, simple_training_estimate
from lmforge.plan.hardware import CATALOGUE, Cluster, Device, get_device, load_devices, parse_cluster
from lmforge.plan.memory import (Layout, MemoryBreakdown, activation_bytes_per_layer, estimate_memory,
                                 model_state_bytes_per_param, param_specs)
from lmforge.plan.search import Candidate, search_layouts

__all__ = [
    "CATALOGUE", "Candidate", "Cluster", "Device", "Layout", "MemoryBreakdown", "StepEstimate",
    "activation_bytes_per_layer", "estimate_memory", "estimate_step", "flops_per_token", "get_device",
    "load_devices", "model_state_bytes_per_param", "param_specs", "parse_cluster", "pipeline_bubble",
    "search_layouts", "simple_training_estimate",
]
