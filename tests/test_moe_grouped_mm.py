"""MoE's routed path on the grouped GEMM (lmforge.model.moe; issue 42 item 3): the experts' rows laid
out on the device in groups aligned as torch's CUDA kernel needs, with the numbers of the per-expert
loop in fp32 and bf16 (outputs and the gradients of inputs and weights); no host read anywhere in the
routed path (counted by a dispatch mode, and proved by running it on fake tensors, which hold no
values); bf16 autocast inside `Precision.step` takes torch._grouped_mm on bf16 operands with int32
offsets aligned to 8 rows, the expert weights cast once per step; and the rule that takes the grouped
GEMM on a CUDA GPU (checked on fake CUDA tensors: the routed path has no other device branch, so the
CPU runs here the layout and the calls a GPU makes)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from lmforge.model.moe import GroupedExperts, aligned_offsets, aligned_rows, experts_loop, grouped_matmul
from lmforge.train.precision import make_precision
from tests.test_moe import DIM, make_moe, naive_moe

aten = torch.ops.aten

# ops whose output size depends on the values: on CUDA each copies from the device inside its kernel
VALUE_SIZED = {aten.nonzero.default, aten.masked_select.default, aten.bincount.default, aten._unique2.default,
               aten.unique_dim.default, aten.unique_consecutive.default}


class HostReads(TorchDispatchMode):
    """Records every op that brings a tensor's values to the host: aten._local_scalar_dense (what
    .item(), int(), float() and bool() of a tensor dispatch to), the VALUE_SIZED ops, a boolean-mask
    index (a nonzero inside), repeat_interleave without output_size, and (patched in by `host_reads`)
    Tensor.tolist / numpy, which read CPU memory without dispatching."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default or func in VALUE_SIZED:
            self.reads.append(str(func))
        elif func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.reads.append("boolean index")
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.reads.append("repeat_interleave without output_size")
        return func(*args, **kwargs)


def host_reads(fn) -> list[str]:
    spy = HostReads()
    tolist, numpy = torch.Tensor.tolist, torch.Tensor.numpy

    def reading(name, method):
        def read(self, *a, **k):
            spy.reads.append(name)
            return method(self, *a, **k)
        return read

    with mock.patch.object(torch.Tensor, "tolist", reading("tolist", tolist)), \
            mock.patch.object(torch.Tensor, "numpy", reading("numpy", numpy)), spy:
        fn()
    return spy.reads


class OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


class GroupedCalls(TorchDispatchMode):
    """Records each aten._grouped_mm call: operand dtypes and the offsets."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._grouped_mm.default:
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            self.calls.append((args[0].dtype, args[1].dtype, args[0].dim(), args[1].dim(), offs.dtype, offs.tolist()))
        return func(*args, **kwargs)


def train_step(layer, x):
    """Forward (training: the balancing statistics and aux losses too) and backward."""
    layer.train()
    y = layer(x)
    y.float().pow(2).sum().backward()
    return y


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max()) <= tol * float(b.abs().max())


def test_aligned_offsets_round_every_group_up_and_stay_under_the_static_bound():
    starts, offs = aligned_offsets(torch.tensor([0, 3, 8, 9, 0]), 8)
    assert starts.tolist() == [0, 8, 16, 24, 40] and offs.tolist() == [8, 16, 24, 40, 48]
    assert offs.dtype == torch.int32
    starts, offs = aligned_offsets(torch.tensor([0, 3, 8]), 1)
    assert starts.tolist() == [0, 0, 3] and offs.tolist() == [0, 3, 11]
    torch.manual_seed(0)
    for _ in range(50):
        experts = int(torch.randint(1, 40, ()))
        counts = torch.bincount(torch.randint(0, experts, (int(torch.randint(0, 300, ())),)), minlength=experts)
        for align in (1, 4, 8):
            _, offs = aligned_offsets(counts, align)
            assert int(offs[-1]) <= aligned_rows(int(counts.sum()), experts, align)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["on", "off"])  # the padded grouped GEMM; the padded batched matmul
def test_expert_groups_equal_the_per_expert_loop_in_outputs_and_gradients(dtype, mode):
    torch.manual_seed(0)
    experts = GroupedExperts(8, DIM, 48, mode)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    counts = torch.tensor([5, 0, 9, 1, 0, 7, 12, 3])
    x = torch.randn(int(counts.sum()), DIM, requires_grad=True)
    rows = x.to(dtype)
    assert experts.uses_grouped_mm(rows) == (mode == "on")
    assert experts.row_alignment(rows) == (16 // rows.element_size() if mode == "on" else 1)
    y = experts.sorted_rows(rows, counts)
    ref = experts_loop(rows, counts, *(w.to(dtype) for w in (experts.w_gate, experts.w_up, experts.w_down)))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert y.dtype == dtype and close(y, ref, tol)
    g = torch.randn_like(ref)
    params = [x, experts.w_gate, experts.w_up, experts.w_down]
    for a, b in zip(torch.autograd.grad(y, params, g), torch.autograd.grad(ref, params, g)):
        assert a.dtype == torch.float32 and close(a, b, tol)


@pytest.mark.parametrize("variant", [{}, {"capacity_factor": 0.5, "shared_experts": 1, "router": "sigmoid"}])
def test_moe_layer_under_bf16_autocast_matches_the_naive_reference(variant):
    layer = make_moe(**variant)
    layer.eval()
    x = torch.randn(3, 7, DIM, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        ref = naive_moe(layer, x)
    assert y.dtype == torch.float32 and close(y, ref, 3e-2)
    g = torch.randn_like(y)
    params = [x, *layer.parameters()]
    for a, b in zip(torch.autograd.grad(y, params, g), torch.autograd.grad(ref, params, g)):
        assert close(a, b, 3e-2)


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
@pytest.mark.parametrize("autocast", [False, True])
def test_routed_path_reads_nothing_on_the_host(capacity_factor, autocast):
    layer = make_moe(capacity_factor=capacity_factor, shared_experts=1, aux_loss_coef=0.1, z_loss_coef=0.01)
    x = torch.randn(2, 16, DIM, requires_grad=True)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            train_step(layer, x)

    assert host_reads(step) == []
    assert layer.take_stats().tokens == 32  # (the statistics were kept, on the device, to be read here)
    layer.experts.mode = "off"  # the spy does see a host read: the fallback's offsets
    assert host_reads(step) == ["tolist"]


def test_routed_path_runs_on_fake_tensors_that_hold_no_values():
    with FakeTensorMode(allow_fallback_kernels=False):  # any read of a value raises
        torch.set_default_dtype(torch.bfloat16)  # (torch's fake _grouped_mm takes bf16 only)
        try:
            layer = make_moe(capacity_factor=0.5, shared_experts=1, z_loss_coef=0.01)
        finally:
            torch.set_default_dtype(torch.float32)
        x = torch.randn(2, 16, DIM, dtype=torch.bfloat16, requires_grad=True)
        train_step(layer, x)
        assert layer.experts.w_gate.grad.shape == layer.experts.w_gate.shape
        layer.experts.mode = "off"
        with pytest.raises(DataDependentOutputException):  # the fallback reads its offsets
            train_step(layer, x)


def test_bf16_step_takes_the_grouped_gemm_with_aligned_int32_offsets_and_one_weight_copy():
    layer = make_moe(capacity_factor=1.0, shared_experts=1)
    precision = make_precision("bf16", torch.device("cpu"))
    experts = layer.experts
    masters = {name: p for name, p in experts.named_parameters()}
    casts = []

    class WeightCasts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is aten._to_copy.default and any(args[0] is p for p in masters.values()):
                casts.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    recorder = GroupedCalls()
    with WeightCasts(), recorder, precision.step(layer):
        assert all(getattr(experts, name).dtype == torch.bfloat16 for name in masters)  # the step's copies
        for _ in range(2):  # two micro-batches, one copy
            with precision.autocast():
                train_step(layer, torch.randn(2, 16, DIM, requires_grad=True))
    assert len(casts) == 3  # w_gate, w_up, w_down: once for the step
    assert all(getattr(experts, name) is p and p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0
               for name, p in masters.items())
    # per micro-batch: 3 projections forward; backward, 3 input gradients (rows x stacked weights too)
    # and 3 weight gradients (rows^T x output gradients: 2-D x 2-D, grouped along the rows)
    assert [c[2:4] for c in recorder.calls].count((2, 3)) == 2 * 6
    assert [c[2:4] for c in recorder.calls].count((2, 2)) == 2 * 3 and len(recorder.calls) == 2 * 9
    for a_dtype, b_dtype, _, _, offs_dtype, ends in recorder.calls:
        assert (a_dtype, b_dtype, offs_dtype) == (torch.bfloat16, torch.bfloat16, torch.int32)
        sizes = [end - start for start, end in zip([0, *ends[:-1]], ends)]
        assert len(sizes) == 6 and all(size % 8 == 0 and size >= 8 for size in sizes), sizes


def test_cuda_rule_takes_the_grouped_gemm_in_bf16_on_hopper_and_blackwell():
    experts = GroupedExperts(8, 64, 128)
    with FakeTensorMode():  # (CUDA-device tensors of metadata only: the rule reads no values)
        rows = torch.empty(40, 64, dtype=torch.bfloat16, device="cuda")
        for capability, grouped in [((9, 0), True), ((10, 0), True), ((8, 0), False), ((12, 0), False)]:
            with mock.patch("torch.cuda.get_device_capability", return_value=capability):
                assert experts.uses_grouped_mm(rows) is grouped, capability
                assert experts.row_alignment(rows) == (8 if grouped else 1)
        with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
            assert not experts.uses_grouped_mm(rows.float())  # (fp32: torch's per-group fallback reads offsets)
            assert not GroupedExperts(8, 60, 128).uses_grouped_mm(torch.empty(40, 60, dtype=torch.bfloat16,
                                                                             device="cuda"))  # 120-byte rows


def test_cuda_grouped_matmul_copies_weights_that_start_off_16_bytes():
    """A weight that is a view into a larger buffer (FSDP2's gathered parameters) is copied before
    torch._grouped_mm on CUDA, whose TMA loads want 16-byte starts (fake CUDA tensors)."""
    with FakeTensorMode():
        x = torch.empty(16, 64, dtype=torch.bfloat16, device="cuda")
        offs = torch.empty(8, dtype=torch.int32, device="cuda")
        buffer = torch.empty(8 * 64 * 128 + 8, dtype=torch.bfloat16, device="cuda")
        for offset, copied in [(0, False), (4, True), (8, False)]:  # 8 bytes off, then 16
            w = torch.as_strided(buffer, (8, 64, 128), (64 * 128, 128, 1), offset)
            with OpNames() as ops:
                assert grouped_matmul(x, w, offs).shape == (16, 128)
            assert ("aten.clone.default" in ops.names) is copied and "aten._grouped_mm.default" in ops.names


def test_benchmark_reports_every_path_and_the_one_auto_takes(tmp_path):
    """benchmarks/moe_grouped_gemm.py as the GPU suite calls it (--device --dtype --json), tiny here."""
    spec = importlib.util.spec_from_file_location(
        "moe_grouped_gemm", Path(__file__).resolve().parents[1] / "benchmarks" / "moe_grouped_gemm.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "moe.json"
    report = bench.main(["--device", "cpu", "--dtype", "bf16", "--tokens", "64", "--experts", "4", "--dim", "32",
                         "--hidden", "48", "--reps", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["schema"] == "lmforge.moe_grouped_gemm/1" and report["dtype"] == "bf16"
    (row,) = report["results"]
    assert row["experts"] == 4 and row["auto_path"] == "grouped_mm"
    for path in report["paths"]:
        assert math.isfinite(row["tokens_per_s"][path]) and row["tokens_per_s"][path] > 0


def test_grouped_matmul_takes_a_stride_0_gradient_and_returns_no_view():
    """`torch._grouped_mm`'s backward refuses the expanded (stride-0) gradient of `.sum()`; the
    output is made contiguous in backward by a hook, not by an identity autograd Function whose
    output would be a view (FSDP2 warns on every rank when a wrapped module, here the experts under
    expert parallelism, returns a view: an in-place op on it would skip its pre-backward hook)."""
    from lmforge.model.moe import grouped_matmul

    x = torch.randn(32, 16, requires_grad=True)
    w = torch.randn(2, 16, 8, requires_grad=True)
    offs = torch.tensor([16, 32], dtype=torch.int32)
    out = grouped_matmul(x, w, offs)
    assert out._base is None
    out.sum().backward()
    torch.testing.assert_close(w.grad[0], x[:16].detach().sum(0)[:, None].expand(16, 8))
