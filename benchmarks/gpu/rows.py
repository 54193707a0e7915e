"""The GPU suite's rows, in the order they run, and the plan of a window: which rows, how long each is
expected to take, and what fits the budget. `suite.py` runs them; `suite.py --dry-run` prints the plan.

A row's expected seconds come from the last measured run stored in benchmarks/gpu/expected_seconds.json
(`suite.py --record-times OUT/gpu_suite.json` writes a run's measured seconds there), else from the
row's own estimate here, which says how it was made. A throughput row is one line:

    throughput("gpt2-bf16-pure", "gpt2-124m", GPT2 + ("train.precision=bf16-pure",), 45, "as gpt2-loss_chunk")
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

EXPECTED_FILE = Path(__file__).with_name("expected_seconds.json")
GPT2 = ("train.micro_batch_size=16", "train.global_batch_size=64")
LLAMA_1B = ("train.micro_batch_size=4", "train.global_batch_size=16", "train.compile=true", "train.loss_chunk=4096",
            "train.activation_checkpoint=none")  # (as the 49.9% MFU was measured, benchmarks/RESULTS.md)
# the CPU smoke's training rows step 8 sequences, not the presets' 32: they check the scripts, not the numbers
CPU_SMOKE_BATCH = ("train.micro_batch_size=8", "train.global_batch_size=8")
START_S = 5  # a warm process's start on the lent H100 (import torch + CUDA init), read off the measured rows


@dataclass(frozen=True)
class RowSpec:
    name: str
    step: str  # the Suite method that runs it: step_<step>(spec)
    estimate_s: float  # expected seconds on one H100 (cpu-smoke rows: on the 2-core CI box) without a measurement
    estimate_how: str  # how the estimate was made
    limit_s: float  # the row is killed after this long (x --limit-scale): a safety net, not a plan
    what: str = ""
    args: dict = field(default_factory=dict)  # the step's own settings
    required: bool = True  # a failed required row fails the suite; an optional one is reported only
    where: str = "both"  # "gpu": on a GPU only; "cpu": the --cpu-smoke stand-in of GPU-only rows; "both"
    default: bool = True  # in the default plan; False: proven on a GPU and unchanged since, run by --rows / all


def throughput(name: str, preset: str, sets: tuple[str, ...], estimate_s: float, estimate_how: str, *,
               limit_s: float = 420, reference: bool = False, profile: bool = False, required: bool = True,
               needs: str = "", against: str = "", check: str = "", what: str = "", default: bool = True) -> RowSpec:
    """A benchmarks/train_throughput.py row on the GPU: tokens/s, MFU, peak memory against the plan.
    `needs`: a module the row needs (skipped with the reason without it); `against`: an earlier row
    whose tokens/s and MFU it is compared with; `check`: "compile_choice" (gpt2-compile's rule check)."""
    return RowSpec(name, "throughput", estimate_s, estimate_how, limit_s, what or f"{preset} tokens/s and MFU",
                   {"preset": preset, "sets": sets, "reference": reference, "profile": profile, "needs": needs,
                    "against": against, "check": check}, required, "gpu", default)


ROWS: tuple[RowSpec, ...] = (
    # what must be confirmed first: the CUDA training paths and checkpoints the last window found broken
    RowSpec("env", "env", 13, "", 120, "python, torch, the GPU; every torch API lmforge's source uses"),
    RowSpec("tiny-bf16", "train", 16, "", 300, "`lmforge train`, tiny preset, 100 steps, bf16, compile off",
            {"steps": 100}),
    RowSpec("fsdp-1", "train", 24, "", 240, "torchrun, zero_stage 3: FSDP2 at shard degree 1 (NCCL)",
            {"steps": 30, "torchrun": 1, "extra": ("--parallel.zero_stage", "3")}),
    RowSpec("ddp-1", "train", 19, "", 240, "torchrun: DDP at world size 1 (NCCL all-reduce)",
            {"steps": 30, "torchrun": 1}),
    RowSpec("ckpt-save", "ckpt_save", 40,
            f"{START_S} s start + 3 s to build GPT-2 124M with AdamW state + 6 saves of 1.5 GB x ~5 s (write + "
            "fsync, sha256, re-hash and test load; the CPU VM took ~10 s a save at its slower disk)", 240,
            "benchmarks/checkpoint_save.py, GPT-2 124M, 3 saves a mode; fails if any save failed"),
    RowSpec("ckpt-resume", "resume", 20,
            f"{START_S} s start + 2 tiny runs (40 + 20 steps at ~30 ms, 3 saves of 34 MB, validation) of ~6 s; "
            "tiny-bf16 took 16 s for 100 steps in its own process", 180,
            "benchmarks/resume_parity.py: N straight steps vs N/2 + resume + N/2 in bf16, max |weight diff|"),
    # what has never been measured on a GPU, or is a target
    throughput("gpt2-loss_chunk", "gpt2-124m", GPT2 + ("train.compile=true", "train.loss_chunk=4096"), 37, "",
               profile=True, what="GPT-2 124M, compile + chunked loss (profiled): the 500k tokens/s target"),
    RowSpec("throughput-quick", "throughput", 60, "", 300, "benchmarks/train_throughput.py --quick (tiny, profiled)",
            {"preset": "tiny", "sets": CPU_SMOKE_BATCH, "reference": True, "profile": True}, where="cpu"),
    throughput("llama-1b", "llama-1b", LLAMA_1B, 55, "", limit_s=480, profile=True,
               what="the ~1B Llama preset, activation checkpointing off (profiled): the 50% MFU target"),
    RowSpec("moe-bf16", "moe", 25,
            f"two processes of {START_S} s start: benchmarks/moe_grouped_gemm.py (3 arms x 2 expert counts x 12 "
            "forward+backward passes of ~10 ms) and a train_throughput.py run of a 4-layer MoE (15 steps of ~50 "
            "ms + one profiled step)", 240,
            "MoE in bf16: grouped_mm forced on vs padded vs the per-expert loop (moe_grouped_gemm.py --device "
            "--dtype), and the path model.moe.grouped_mm = auto takes in training, with tokens/s"),
    # (the 2026 families joined this row after its GPU run: `--rows families` runs them on the next GPU,
    # outside the default plan, which fills its 8 minutes)
    RowSpec("families", "families", 35,
            f"{START_S} s start + 6 x (setup ~2 s + 20 steps of a 2-4-layer model + two validations) of ~5 s", 240,
            "benchmarks/family_shapes.py: 2-layer Llama-3.1 (RoPE scaling), Qwen2.5 (q/k/v bias), Qwen3 "
            "(QK-norm), Qwen3-Next's hybrid (4 layers: Gated DeltaNet's chunked PyTorch form, gated attention), "
            "Gemma 3 and OLMo 3 (local/global), 20 steps in bf16, validated with the chunked loss at vocab 8192 "
            "against the plain one", default=False),
    throughput("fp8-1b", "llama-1b", LLAMA_1B + ("train.fp8=true",), 55,
               "as llama-1b (55 s measured: the same model, build and per-block compile), without its profile; "
               "torchao's float8 linears compile with the blocks", limit_s=420, required=False,
               needs="torchao.float8", against="llama-1b", default=False,
               what="llama-1b with train.fp8 (torchao, carried as a wheel) against the bf16 llama-1b row"),
    RowSpec("fp8-config", "fp8_config", 10, "", 120, "torchao.float8 imports; the fp8 config loads",
            required=False, where="cpu"),
    # issue 55 item 2: FSDP2's FP8 all-gather on NCCL (gloo has no float8 type: tests/test_fp8.py checks the same
    # arithmetic on the CPU with the gathers in high precision); at shard degree 1 FSDP2 still runs its gather path
    RowSpec("fp8-fsdp-1", "train", 28,
            f"as fsdp-1 (23 s measured: torchrun, 30 tiny steps) + ~{START_S} s to import torchao and convert", 240,
            "torchrun, zero_stage 3 with train.fp8 (tensorwise): FSDP2 gathers the FP8 weights in FP8 on NCCL",
            {"steps": 30, "torchrun": 1, "needs": "torchao.float8",
             "extra": ("--parallel.zero_stage", "3", "--train.fp8", "true", "--train.fp8_all_gather", "true")},
            required=False, where="gpu", default=False),
    # the references compile's rule is read against (the plain loop; compile = auto's choice): proven on
    # 2026-11-26 and 2026-11-27 and unchanged since, so out of the default plan since the peer row joined it
    # (`--rows gpt2-plain,gpt2-compile`)
    throughput("gpt2-plain", "gpt2-124m", GPT2 + ("train.compile=false", "train.loss_chunk=0"), 24, "",
               limit_s=300, reference=True, what="GPT-2 124M eager, plain loss, against the plain PyTorch loop",
               default=False),
    throughput("gpt2-compile", "gpt2-124m", GPT2 + ("train.compile=true", "train.loss_chunk=0"), 36, "",
               check="compile_choice", default=False,
               what="compile alone; fails if train.compile = auto picks the slower of it and gpt2-plain"),
    # proven on 2026-11-26 and 2026-11-27 (benchmarks/RESULTS.md) and unchanged since: not in the default
    # plan (`--rows families,fp8-1b,head-loss,async-2,optim`, or `--rows all`)
    RowSpec("head-loss", "head_loss", 58, "", 300,
            "output head + cross-entropy, plain vs fused chunked; fails if train.loss_chunk = auto picks the slower",
            default=False),
    RowSpec("async-2", "train", 20, "", 240, "asynchronous SGD, server + worker on the one GPU (gloo default group)",
            {"steps": 30, "torchrun": 2, "extra": (
                "--parallel.dp_replicate", "2", "--parallel.async_sgd", "true", "--train.global_batch_size", "8",
                "--train.micro_batch_size", "4", "--checkpoint.every_steps", "0")}, default=False),
    RowSpec("optim", "optim", 16, "", 300, "tests/test_optim_cuda.py: fused / foreach optimizers on CUDA",
            default=False),
    # issue 43: bf16 end to end (train.precision = bf16-pure) and the whole model compiled, also a group:
    # `--rows gpt2-bf16-pure,gpt2-bf16-pure-model,llama-1b-bf16-pure`. On 2026-11-27 the bf16-pure rows
    # ran (GPT-2 442k tok/s, the 1B 50.9% MFU) and the whole-model row failed in dynamo (fixed since, not
    # yet confirmed): that row and the one it is read against are in the default plan
    throughput("gpt2-bf16-pure", "gpt2-124m", GPT2 + ("train.compile=true", "train.loss_chunk=4096",
                                                      "train.precision=bf16-pure"), 40,
               "as gpt2-loss_chunk (38 s measured: the same model, per-block compile and chunked loss; bf16-pure "
               "changes the dtypes, not the work)", against="gpt2-loss_chunk",
               what="gpt2-loss_chunk in bf16-pure (bf16 weights, activations and residual stream; fp32 masters)"),
    # issue 55: a peer side by side, same GPU, same call, same shape and tokens (benchmarks/gpu/peers.py; the
    # peers travel in the window: --prepare DIR --nanogpt PATH [--llmc PATH]); optional: a peer's failure is
    # reported, not lmforge's. Before the whole-model row, whose compile is the plan's least certain time
    RowSpec("peer-nanogpt", "peer", 65,
            f"{START_S} s start + ~50 s for torch.compile of nanoGPT's whole GPT-2 forward and backward (its "
            "train.py prints 'takes a ~minute'; no evaluation batch, so no second compile) + 26 iterations of "
            "~0.15 s (gpt2-loss_chunk's 65,536 tokens a step at ~430k tok/s)", 300,
            "nanoGPT's train.py (compile, bf16 autocast) at gpt2-loss_chunk's shape and tokens in the same call: "
            "its tokens/s, and lmforge / nanoGPT (target 1.10x)",
            {"peer": "nanogpt", "shape_of": "gpt2-loss_chunk", "target": 1.10,
             "against": ("gpt2-loss_chunk", "gpt2-bf16-pure", "gpt2-bf16-pure-model")}, required=False),
    RowSpec("peer-llmc", "peer", 50,
            f"{START_S} s start + ~20 s to build train_gpt2cu without cuDNN (llm.c's Makefile: 'a few seconds' "
            "without it, '~minute' with) + 26 steps of ~0.15 s + two one-batch validations", 300,
            "llm.c's train_gpt2cu (built with nvcc, where the device has it) at gpt2-loss_chunk's shape and tokens",
            {"peer": "llmc", "shape_of": "gpt2-loss_chunk", "target": 1.10,
             "against": ("gpt2-loss_chunk", "gpt2-bf16-pure", "gpt2-bf16-pure-model")}, required=False,
            where="gpu", default=False),
    throughput("gpt2-bf16-pure-model", "gpt2-124m", GPT2 + ("train.compile=model", "train.loss_chunk=4096",
                                                            "train.precision=bf16-pure"), 90,
               f"{START_S} s start + ~60 s to compile the whole forward and backward as one graph (nanoGPT's "
               "whole-model compile of GPT-2 124M: 'takes a ~minute'; gpt2-compile's per-block compile took ~11 s "
               "of its 33 s over gpt2-plain's 22) + build and measured steps as gpt2-plain (~20 s)",
               limit_s=480, against="gpt2-bf16-pure",
               what="gpt2-bf16-pure with train.compile = model (one fullgraph: forward + chunked loss) against "
                    "per-block compile"),
    throughput("llama-1b-bf16-pure", "llama-1b", LLAMA_1B + ("train.precision=bf16-pure",), 55,
               "as llama-1b (52 s measured: the same model, build, per-block compile and profile-free steps)",
               limit_s=480, against="llama-1b", default=False,
               what="llama-1b in bf16-pure against the bf16 autocast llama-1b row: the 55% MFU goal"),
)


def rows_for(cuda: bool) -> list[RowSpec]:
    """The rows of a GPU run (cuda) or of the CPU smoke run, in the default order."""
    return [r for r in ROWS if r.where == "both" or r.where == ("gpu" if cuda else "cpu")]


def select(names: str, cuda: bool) -> list[RowSpec]:
    """--rows a,b,c: those rows, in that order ("" = the default plan; "all" = every row, in order)."""
    table = {r.name: r for r in rows_for(cuda)}
    if names.strip() == "all":
        return list(table.values())
    if not names:  # (the CPU smoke run, CI's check of every row's scripts, runs them all)
        return [r for r in table.values() if r.default or not cuda]
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in table]
    if unknown:
        raise ValueError(f"--rows: no row {', '.join(unknown)} in the {'GPU' if cuda else 'CPU smoke'} suite; "
                         f"the rows: {', '.join(table)}")
    return [table[n] for n in chosen]


def mode_key(cuda: bool) -> str:
    return "gpu" if cuda else "cpu-smoke"


def load_expected(path: Path = EXPECTED_FILE) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def expected(spec: RowSpec, cuda: bool, stored: dict) -> tuple[float, str]:
    """(seconds, where the number comes from) for one row."""
    rec = stored.get(mode_key(cuda), {}).get(spec.name)
    if rec:
        return float(rec["seconds"]), f"measured: {rec['source']}"
    if not cuda:  # (the estimates are for a GPU)
        return spec.limit_s / 3, "not measured on the CPU: a third of the row's time limit"
    if not spec.estimate_how:
        raise AssertionError(f"row {spec.name}: no stored measurement and no estimate_how")  # (tests check this)
    return float(spec.estimate_s), f"estimate: {spec.estimate_how}"


@dataclass
class Plan:
    rows: list[tuple[RowSpec, float, str]]  # (row, expected seconds, source)
    budget_s: float

    @property
    def total_s(self) -> float:
        return sum(s for _, s, _ in self.rows)

    def text(self, cuda: bool) -> str:
        where = "one H100 (GPU rows)" if cuda else "the 2-core CPU box (--cpu-smoke)"
        lines = [f"plan: {len(self.rows)} rows, expected on {where}; budget {self.budget_s / 60:.1f} min", "",
                 f"{'#':>2}  {'row':<22} {'expected':>8}  {'by then':>7}  source"]
        done = 0.0
        for i, (spec, s, source) in enumerate(self.rows, 1):
            done += s
            over = "  (over the budget: would be skipped)" if done > self.budget_s else ""
            lines.append(f"{i:>2}  {spec.name + ('' if spec.required else ' (opt)'):<22} {s:>6.0f} s  "
                         f"{done:>5.0f} s  {source}{over}")
        lines += ["", f"total: {self.total_s:.0f} s = {self.total_s / 60:.1f} min (budget {self.budget_s:.0f} s)"]
        return "\n".join(lines)


def plan(specs: list[RowSpec], cuda: bool, budget_s: float, stored: dict | None = None) -> Plan:
    stored = load_expected() if stored is None else stored
    return Plan([(s, *expected(s, cuda, stored)) for s in specs], budget_s)


def record_times(suite_json: Path, path: Path = EXPECTED_FILE) -> list[str]:
    """Store the measured seconds of a suite run's rows that passed (its gpu_suite.json) as the rows'
    expected seconds; returns what changed, one line a row."""
    run = json.loads(Path(suite_json).read_text())
    key = run["mode"]
    stored = load_expected(path)
    table = stored.setdefault(key, {})
    source = f"{run['device']}, {run['date']}, commit {run['commit']} (suite run)"
    changed = []
    for row in run["rows"]:
        if row["status"] == "ok" and row["seconds"] > 0:
            old = table.get(row["step"], {}).get("seconds")
            table[row["step"]] = {"seconds": round(row["seconds"]), "source": source}
            changed.append(f"{row['step']}: {old if old is not None else '-'} -> {round(row['seconds'])} s")
    path.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
    return changed
