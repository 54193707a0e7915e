"""Hardware catalogue: accelerators with memory, dense peak FLOP/s and bandwidths.

Conventions (stated once, used everywhere in `lmforge.plan`):

- Memory is in decimal gigabytes (1 GB = 1e9 bytes), the vendors' marketed capacity. The planner
  keeps headroom for the CUDA context, allocator fragmentation and workspaces separately
  (`usable_fraction` in the search), rather than shrinking the figures here.
- Peaks are *dense* tensor-core TFLOP/s (no 2:4 sparsity), per device, from the vendors' data
  sheets. `None` means the precision is not supported by the matrix units (e.g. bf16 on V100):
  asking for it raises a ValueError rather than silently using another number.
- `host_memory_gb` is the host RAM of one node (the reference system's: DGX-1 / DGX A100 / DGX
  H100 ...), which CPU offload of a whole node's GPUs must fit in; `None` where no reference system
  fixes it (the CLI's `--host-memory-gb` then supplies it).
- `hbm_gbps` is the device memory's bandwidth (GB/s); the step-time model needs it (its elementwise,
  loss and optimizer kernels move bytes at a measured fraction of it: `Calibration`).
- The step-time model's constants (`Calibration`) were measured on one H100; every device takes the
  same fractions of its own dense peak and memory bandwidth, and the same latencies (a GEMM's fixed
  cost, the host's time per launch): an estimate for devices not measured, stated as such.
- Bandwidths are GB/s per device, *one direction*: `intra_node_gbps` is the NVLink/ICI (or PCIe)
  bandwidth to the other devices of the same node, `inter_node_gbps` is the network bandwidth per
  device across nodes (one NIC per GPU: 100/200/400 Gb/s InfiniBand = 12.5/25/50 GB/s).

Extra devices come from a TOML file, one table per device:

    [MI300X]
    memory_gb = 192
    bf16_tflops = 1307
    fp16_tflops = 1307
    fp32_tflops = 163
    fp8_tflops = 2615
    hbm_gbps = 5300
    intra_node_gbps = 448
    inter_node_gbps = 50
    gpus_per_node = 8
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

PRECISIONS = ("bf16", "fp16", "fp32", "fp8")
# A run's precision -> the matrix units' precision it computes in ("bf16-pure": bf16 weights and
# activations with fp32 master weights in the optimizer; its matmuls are bf16 matmuls).
_COMPUTE = {"bf16-pure": "bf16"}


def compute_precision(precision: str) -> str:
    """The peak a run of `precision` computes at: the precision itself, bf16 for "bf16-pure"."""
    return _COMPUTE.get(precision, precision)


@dataclass(frozen=True)
class Calibration:
    """The step-time model's constants (lmforge.plan.op_time), measured on one device: fractions of
    its spec sheet where a rate scales with the device, seconds where it is a latency. Another device
    gets the same fractions of its own spec sheet (`Device.rates`)."""

    matmul_fraction: float       # practical dense GEMM rate / dense spec peak
    gemm_fixed_s: float          # per GEMM kernel beyond f / rate: ramp-up and the last partial wave
    attention_fraction: float    # SDPA's PaLM-counted FLOPs (12 L h s per token) per second / dense peak
    elementwise_fraction: float  # bytes per second of memory-bound kernels / HBM spec bandwidth
    optimizer_fraction: float    # bytes per second of the optimizer-step and clip kernels / HBM spec
    host_launch_s: float         # host time per kernel launch (the device waits where a kernel is shorter)
    source: str = ""


# Fitted on one NVIDIA H100 80GB HBM3 (SXM: 989 TFLOP/s dense bf16, 3,350 GB/s HBM3), torch 2.11.0+cu130,
# 2026-11-26, to the profile of GPT-2 124M (16 x 1024 tokens x 4 micro-batches, bf16 autocast,
# per-block compile, compiled chunk loss, fused QKV: 151.6 ms a step; benchmarks/RESULTS.md, "GPU:
# one H100, 2026-11-26", the profile's right-hand column), one constant per profile line; the numbers
# and the derivation: benchmarks/plan_measured_h100.toml and `python benchmarks/plan_calibration.py`
# (tests/test_plan_time.py checks that these are what it derives):
H100_CALIBRATION = Calibration(
    # 790 TFLOP/s: a large bf16 GEMM measured on the lent H100 (the project's environment facts,
    # DESIGN.md section 2); not fitted to the training rows
    matmul_fraction=0.799,
    # the profile's matmul line, 67.8 ms for 4.86e13 FLOPs in 624 GEMMs: (67.8 ms - FLOPs / 790e12) / 624
    gemm_fixed_s=10.1e-6,
    # the attention line, 18.2 ms for 7.42e12 PaLM-counted FLOPs (cuDNN SDPA, head_dim 64)
    attention_fraction=0.412,
    # the loss line, 8.9 ms for one compiled kernel per 4096-token chunk reading the bf16 logits twice
    # and writing their gradient once: 6 bytes x 65,536 tokens x 50,304 logits
    elementwise_fraction=0.663,
    # the optimizer line, 3.4 ms for fused AdamW + the clip over 124.5M parameters (40 bytes each)
    optimizer_fraction=0.437,
    # the host gaps, 151.6 - 142.2 = 9.4 ms: the host time per launch that leaves them, given every
    # kernel's modelled device time
    host_launch_s=17.7e-6,
    source="H100 SXM, torch 2.11, 2026-11-26: GPT-2 124M profile (benchmarks/RESULTS.md)")


@dataclass(frozen=True)
class Rates:
    """A device's rates for the step-time model in one precision (`Device.rates`)."""

    matmul_flops: float          # practical dense GEMM FLOP/s in the run's compute precision
    fp8_matmul_flops: float      # the same for FP8 block linears (0 where the device has no fp8 peak)
    gemm_fixed_s: float
    attention_flops: float       # PaLM-counted attention FLOP/s (SDPA runs in 16 bits: bf16 / fp16 peak)
    elementwise_bps: float
    optimizer_bps: float
    host_launch_s: float


@dataclass(frozen=True)
class Device:
    """One accelerator (or a CPU socket treated as one device)."""

    name: str
    memory_gb: float
    bf16_tflops: float | None
    fp16_tflops: float | None
    fp32_tflops: float | None
    fp8_tflops: float | None
    intra_node_gbps: float
    inter_node_gbps: float
    gpus_per_node: int = 8
    hbm_gbps: float | None = None
    aliases: tuple[str, ...] = field(default=())
    notes: str = ""
    host_memory_gb: float | None = None   # host RAM per node (bounds CPU offload); None = unknown
    calibration: Calibration = H100_CALIBRATION  # the step-time model's constants (the only device measured)

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s (not TFLOP/s) for `precision` ("bf16-pure": bf16); ValueError if unsupported."""
        precision = compute_precision(precision)
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
        tflops = getattr(self, f"{precision}_tflops")
        if not tflops:
            supported = [p for p in PRECISIONS if getattr(self, f"{p}_tflops")]
            raise ValueError(
                f"{self.name} has no {precision} matrix peak; supported: {', '.join(supported)}")
        return float(tflops) * 1e12

    def rates(self, precision: str) -> Rates:
        """The step-time model's rates for a run in `precision`: the calibration's fractions of this
        device's dense peak and HBM bandwidth (its latencies as measured). Attention runs in 16 bits
        except in fp32 runs; FP8 runs keep the output head in bf16."""
        if not self.hbm_gbps:
            raise ValueError(f"{self.name} lists no hbm_gbps (memory bandwidth, GB/s), which the step-time model "
                             f"needs; add it to the devices file")
        cal = self.calibration
        compute = compute_precision(precision)
        matmul = "bf16" if compute == "fp8" else compute
        attention = "fp32" if compute == "fp32" else ("bf16" if self.bf16_tflops else "fp16")
        return Rates(matmul_flops=cal.matmul_fraction * self.peak_flops(matmul),
                     fp8_matmul_flops=cal.matmul_fraction * (self.fp8_tflops or 0.0) * 1e12,
                     gemm_fixed_s=cal.gemm_fixed_s,
                     attention_flops=cal.attention_fraction * self.peak_flops(attention),
                     elementwise_bps=cal.elementwise_fraction * self.hbm_gbps * 1e9,
                     optimizer_bps=cal.optimizer_fraction * self.hbm_gbps * 1e9,
                     host_launch_s=cal.host_launch_s)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["aliases"] = list(self.aliases)
        return d


def _catalogue() -> dict[str, Device]:
    devices = [
        Device("V100", 32, None, 125, 15.7, None, 150, 12.5, 8, 900, ("V100-32GB", "V100-SXM2"),
               "SXM2 32GB; NVLink2 300 GB/s bidirectional; 100 Gb/s IB per GPU. No bf16. Host: DGX-1, 512 GB.",
               host_memory_gb=512),
        Device("A100-40GB", 40, 312, 312, 19.5, None, 300, 25, 8, 1555, ("A100-SXM-40GB",),
               "SXM4; fp32 is non-tensor (TF32 156); NVLink3 600 GB/s bidir; 200 Gb/s HDR per GPU. Host: DGX A100, 1 TB.",
               host_memory_gb=1024),
        Device("A100-80GB", 80, 312, 312, 19.5, None, 300, 25, 8, 2039, ("A100", "A100-SXM-80GB"),
               "SXM4 80GB; as A100-40GB with HBM2e. Host: DGX A100 640GB, 2 TB.", host_memory_gb=2048),
        Device("H100-SXM", 80, 989, 989, 67, 1979, 450, 50, 8, 3350, ("H100", "H100-80GB", "H100-SXM5"),
               "SXM5; NVLink4 900 GB/s bidir; 400 Gb/s NDR per GPU. Host: DGX H100, 2 TB.", host_memory_gb=2048),
        Device("H100-PCIe", 80, 756, 756, 51, 1513, 64, 50, 8, 2000, ("H100-PCIE-80GB",),
               "PCIe Gen5 x16 (64 GB/s per direction) between GPUs of a node."),
        Device("H200", 141, 989, 989, 67, 1979, 450, 50, 8, 4800, ("H200-SXM",),
               "H100 compute with 141 GB HBM3e. Host: DGX H200, 2 TB.", host_memory_gb=2048),
        Device("B200", 180, 2250, 2250, 75, 4500, 900, 50, 8, 8000, ("B200-SXM",),
               "DGX B200 (180 GB usable per GPU); NVLink5 1.8 TB/s bidir. Host: 2 TB (up to 4 TB).",
               host_memory_gb=2048),
        Device("TPU-v4", 32, 275, None, None, None, 150, 25, 4, 1200, ("TPUv4", "v4"),
               "One chip; ICI 6 links; 4 chips per host; bf16 only on the MXUs."),
        Device("CPU", 24, 2.0, None, 0.33, None, 10, 1.25, 1, 40, ("cpu",),
               "This project's 2-core CPU machine, measured (bf16 AMX 2048^3 matmul).", host_memory_gb=24),
    ]
    return {d.name: d for d in devices}


CATALOGUE: dict[str, Device] = _catalogue()


def _index(devices: dict[str, Device]) -> dict[str, Device]:
    idx: dict[str, Device] = {}
    for dev in devices.values():
        for key in (dev.name, *dev.aliases):
            idx[key.lower()] = dev
    return idx


def load_devices(extra_toml: str | Path | None = None, base: dict[str, Device] | None = None) -> dict[str, Device]:
    """The catalogue, plus the devices of `extra_toml` (one table per device; same field names
    as `Device`; `gpus_per_node` defaults to 8). A device of the same name replaces the built-in."""
    devices = dict(CATALOGUE if base is None else base)
    if extra_toml is None:
        return devices
    path = Path(extra_toml).expanduser()
    if not path.is_file():
        raise ValueError(f"device file {str(path)!r} does not exist")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"device file {str(path)!r}: invalid TOML: {exc}") from exc
    names = {f.name for f in dataclasses.fields(Device)} - {"calibration"}
    required = {"memory_gb", "intra_node_gbps", "inter_node_gbps"}
    for dev_name, table in raw.items():
        if not isinstance(table, dict):
            raise ValueError(f"device file {str(path)!r}: {dev_name!r} must be a table [{dev_name}]")
        unknown = set(table) - names
        if unknown:
            raise ValueError(f"device {dev_name!r}: unknown field(s) {sorted(unknown)}; valid: {sorted(names - {'name'})}")
        missing = required - set(table)
        if missing:
            raise ValueError(f"device {dev_name!r}: missing field(s) {sorted(missing)}")
        kw = {p + "_tflops": None for p in PRECISIONS}
        kw.update(table)
        kw["aliases"] = tuple(kw.get("aliases", ()))
        if not any(kw[p + "_tflops"] for p in PRECISIONS):
            raise ValueError(f"device {dev_name!r}: give at least one of {[p + '_tflops' for p in PRECISIONS]}")
        devices[dev_name] = Device(name=dev_name, **kw)
    return devices


def get_device(name: str, devices: dict[str, Device] | None = None) -> Device:
    """Look a device up by name or alias (case-insensitive); ValueError listing the catalogue."""
    devices = CATALOGUE if devices is None else devices
    dev = _index(devices).get(name.strip().lower())
    if dev is None:
        raise ValueError(f"unknown GPU {name!r}; known devices: {', '.join(sorted(devices))} "
                         "(or add one with a devices TOML file)")
    return dev


@dataclass(frozen=True)
class Cluster:
    """`nodes` x `gpus_per_node` identical devices."""

    device: Device
    nodes: int = 1
    gpus_per_node: int = 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def __str__(self) -> str:
        return f"{self.nodes}x{self.gpus_per_node}x{self.device.name}"

    def to_dict(self) -> dict:
        return {"nodes": self.nodes, "gpus_per_node": self.gpus_per_node, "world_size": self.world_size,
                "device": self.device.to_dict()}


_CLUSTER_RE = re.compile(r"^\s*(?:(\d+)\s*[xX*]\s*)?(?:(\d+)\s*[xX*]\s*)?(\S.*?)\s*$")


def parse_cluster(spec: str, nodes: int | None = None, devices: dict[str, Device] | None = None) -> Cluster:
    """Parse "64x8xH100" (nodes x GPUs per node x device), "8xA100-80GB" (one node) or "H100"
    (one device). `nodes` (the CLI's --nodes) multiplies a one-node spec."""
    counts = re.match(r"^\s*([^xX*]*?)[xX*](?:([^xX*]*?)[xX*])?", spec or "")  # what stands before the device
    for count in (counts.groups() if counts else ()):  # a negative or fractional count: say so, not "unknown GPU"
        if count is not None and re.fullmatch(r"[-+]?\d*\.?\d+", count.strip()) and not count.strip().isdigit():
            raise ValueError(f"--gpus {spec!r}: {count.strip()!r} is not a count; node and GPU counts are whole "
                             f"numbers >= 1, e.g. 8xH100 or 64x8xH100")
    m = _CLUSTER_RE.match(spec or "")
    if not m:
        raise ValueError(f"cluster spec {spec!r} must look like 8xH100 or 64x8xH100")
    a, b, name = m.group(1), m.group(2), m.group(3)
    device = get_device(name, devices)
    if a is not None and b is not None:
        n, g = int(a), int(b)
        if nodes is not None and nodes != n:
            raise ValueError(f"--nodes {nodes} contradicts cluster spec {spec!r} ({n} nodes)")
    else:
        g = int(a) if a is not None else 1
        n = nodes if nodes is not None else 1
    if n < 1 or g < 1:
        raise ValueError(f"cluster spec {spec!r}: node and GPU counts must be >= 1")
    return Cluster(device=device, nodes=n, gpus_per_node=g)
