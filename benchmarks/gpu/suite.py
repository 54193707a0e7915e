"""The GPU proof suite: one entry point, run from the source tree on a lent GPU machine, one markdown table.

    python benchmarks/gpu/suite.py --prepare .gpu-window     # on a connected CPU machine: cache + wheels + the command
    python benchmarks/gpu/suite.py --dry-run [--rows a,b]    # the plan: rows, expected seconds, total
    python3 benchmarks/gpu/suite.py --out OUT --wheels W --cache C [--rows a,b,c] [--budget-min 9]   # on the GPU
    python benchmarks/gpu/suite.py --cpu-smoke --out OUT      # the same rows, tiny, on the CPU (CI)
    python benchmarks/gpu/suite.py --record-times OUT/gpu_suite.json   # a run's seconds -> the stored plan

It needs no `pip install` of lmforge: every row runs with PYTHONPATH = this source tree, on the
machine's own PyTorch (2.11 on the lent H100/H200s, 2.13 here). What the machine lacks travels as
wheels (`--wheels DIR`: installed into a private folder, no index, no dependencies) and the data as a
cache folder (`--cache`, made by `--prepare` / `--build-cache` on a connected machine).

The window is planned: the rows run in the order given (`--rows`, else the default order of
benchmarks/gpu/rows.py, where each row says what it checks), each with an expected time (the last
measured run stored in benchmarks/gpu/expected_seconds.json, else the row's stated estimate). A row
whose expected time does not fit what is left of `--budget-min` is skipped with that reason, never
started to be killed. The default budget, 9 minutes, fits the lent machine: 15 minutes of device time
in all, machine start-up included, at most 10 minutes a command. Only a failed required row fails the
suite (exit 1); optional rows (fp8: torchao) are skipped with the reason when what they need is absent.
The table and JSON are rewritten after every row, so a run cut off keeps what it measured.
Targets (benchmarks/RESULTS.md): GPT-2 124M >= 500k tokens/s on one H100; 1B >= 50% MFU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # (lmforge from this source tree, for the plan and the rules the rows check)
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(ROOT / "benchmarks"))  # (train_throughput's synthetic tokens, for the peer rows)
import rows as rowdefs  # noqa: E402  (benchmarks/gpu/rows.py)
from rows import RowSpec  # noqa: E402

BENCH = ROOT / "benchmarks"


class RowFailed(Exception):
    """The row failed; the message is its result."""


class RowSkipped(Exception):
    """The row cannot run here (an optional package is missing); the message says why."""


@dataclass
class Row:
    step: str
    status: str  # ok | failed | skipped
    result: str = ""
    seconds: float = 0.0
    detail: dict = field(default_factory=dict)
    required: bool = True  # a failed required row fails the suite; an optional one is reported only
    expected_s: float = 0.0


def gpu_name() -> str:
    """The GPU's name from nvidia-smi (no torch import: a run of --rows without `env` names it too;
    `env` replaces it with torch's name)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        out = []
    return out[0].strip() if out else "GPU (not yet seen)"


class Suite:
    def __init__(self, args: argparse.Namespace):
        self.args, self.out = args, Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self.deadline = self.started + 60 * args.budget_min
        self.rows: list[Row] = []
        self.cuda = not args.cpu_smoke
        self.device_name = "cpu (--cpu-smoke)" if args.cpu_smoke else gpu_name()
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        paths = [str(ROOT)]
        if getattr(args, "wheels", ""):
            paths.append(install_wheels(Path(args.wheels)))
        self.env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
        if getattr(args, "cache", ""):
            from lmforge.data.corpus import CHECKSUMS_FILE, DEFAULT_CORPUS

            cache = Path(args.cache).resolve()
            if not (cache / "corpus" / DEFAULT_CORPUS.name / CHECKSUMS_FILE).is_file():
                raise SystemExit(f"--cache {args.cache}: no prepared default corpus there (corpus/{DEFAULT_CORPUS.name}/"
                                 f"{CHECKSUMS_FILE}); make the folder on a connected machine with "
                                 f"`python benchmarks/gpu/suite.py --prepare DIR` (benchmarks/gpu/README.md)")
            self.env["LMFORGE_CACHE"] = str(cache)
        self._limit_end = self.deadline

    # ---- the plan and the loop ----------------------------------------------------------------
    def run_rows(self, specs: list[RowSpec]) -> None:
        stored = rowdefs.load_expected()
        scale = self.args.limit_scale
        for spec in specs:
            expected, _ = rowdefs.expected(spec, self.cuda, stored)
            row = Row(spec.name, "ok", required=spec.required, expected_s=expected)
            self.rows.append(row)
            left = self.deadline - time.monotonic()
            if expected * scale > left:
                row.status = "skipped"
                row.result = (f"expected {expected * scale:.0f} s, {max(left, 0):.0f} s left of the "
                              f"{self.args.budget_min:g}-minute budget")
                self.save()
                continue
            self.save()  # (the row is listed while it runs: a suite cut off mid-row still leaves its table)
            t0 = time.monotonic()
            self._limit_end = t0 + min(spec.limit_s * scale, left)
            try:
                getattr(self, f"step_{spec.step}")(spec, row)
            except RowSkipped as e:
                row.status, row.result = "skipped", str(e)
            except RowFailed as e:
                row.status, row.result = "failed", str(e)
            row.seconds = time.monotonic() - t0
            self.save()

    def sub(self, row: Row, cmd: list[str], check: bool = True, cwd: Path = ROOT,
            env: dict | None = None) -> subprocess.CompletedProcess:
        """Run one command of `row` within the row's limit, its output appended to OUT/<row>.log.
        A timeout (the command's whole process group is killed: torchrun's workers too), or (check) a
        non-zero exit, fails the row."""
        t0 = time.monotonic()
        log = self.out / f"{row.step}.log"
        proc = subprocess.Popen(cmd, cwd=cwd, env=env or self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=max(self._limit_end - t0, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            with log.open("a") as f:
                f.write(f"$ {' '.join(cmd)}\n{out}\n{err}\n")
            end = "the budget's end" if self._limit_end >= self.deadline - 1 else "the row's limit"
            raise RowFailed(f"timed out after {time.monotonic() - t0:.0f} s (expected "
                            f"{row.expected_s * self.args.limit_scale:.0f} s): {end}") from None
        with log.open("a") as f:
            f.write(f"$ {' '.join(cmd)}\n{out}\n{err}\n")
        done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        if check and done.returncode != 0:
            raise RowFailed(f"exit {done.returncode}: {last_line(done)}")
        return done

    def needs(self, module: str) -> None:
        """Skip the row (RowSkipped) where `module` does not import in the rows' environment."""
        proc = subprocess.run([sys.executable, "-c", f"import {module}"], env=self.env, capture_output=True,
                              text=True, cwd=ROOT)
        if proc.returncode == 0:
            return
        top = module.split(".")[0]
        if f"No module named '{top}'" in proc.stderr:
            raise RowSkipped(f"{top} is not installed: pass its wheel with --wheels (benchmarks/gpu/README.md)")
        raise RowSkipped(f"{module} does not import: {last_line(proc)}")

    def train_args(self, steps: int) -> list[str]:
        """`lmforge train` options of the functional rows: compile off (what they test is not compile)."""
        steps = steps if self.cuda else 6  # (the CPU smoke run checks the mechanics, not the numbers)
        small = ["--train.steps", str(steps), "--train.eval_every", "0", "--train.sample_tokens", "20",
                 "--train.plot", "false", "--train.progress", "lines", "--train.compile", "false",
                 "--checkpoint.every_steps", str(max(steps // 2, 1))]
        if self.cuda:
            return small + ["--train.device", "cuda", "--train.precision", "bf16"]
        return small + ["--train.device", "cpu", "--train.precision", "fp32", "--train.global_batch_size", "8",
                        "--train.micro_batch_size", "4", "--data.seq_len", "32", "--train.eval_sequences", "32"]

    def torchrun(self, n: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port",
                str(29400 + len(self.rows)), "-m", "lmforge", "train"]

    # ---- the rows ------------------------------------------------------------------------------
    def step_env(self, spec: RowSpec, row: Row) -> None:
        """python, torch, the GPU, and every torch name lmforge's source uses (benchmarks/gpu/torch_apis.py)."""
        code = ("import json, platform, sys, torch; sys.path.insert(0, 'benchmarks/gpu'); import torch_apis, lmforge\n"
                "res = torch_apis.check(torch_apis.scan())\n"
                "gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'\n"
                "print(json.dumps({'python': platform.python_version(), 'torch': torch.__version__, 'gpu': gpu,\n"
                "    'capability': list(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None,\n"
                "    'lmforge': lmforge.__file__, **res}))")
        info = json.loads(self.sub(row, [sys.executable, "-c", code]).stdout.strip().splitlines()[-1])
        row.detail = info
        if info["gpu"] != "none":
            self.device_name = info["gpu"]
        apis = (f"MISSING torch APIs: {', '.join(info['missing'])}" if info["missing"]
                else f"all {info['checked']} torch names lmforge uses present")
        detected = (f"; absent, feature-detected: {', '.join(info['missing_detected'])}"
                    if info["missing_detected"] else "")
        row.result = (f"python {info['python']}, torch {info['torch']}, {info['gpu']}; lmforge from the source tree; "
                      f"{apis}{detected}")
        if info["missing"]:
            raise RowFailed(row.result)
        if self.cuda and info["gpu"] == "none":
            raise RowFailed("no CUDA device visible: " + row.result)

    def step_train(self, spec: RowSpec, row: Row) -> None:
        """`lmforge train` (under torchrun for `torchrun` processes): val loss, tokens/s, peak memory."""
        a = spec.args
        if a.get("needs"):
            self.needs(a["needs"])
        base = self.torchrun(a["torchrun"]) if a.get("torchrun") else [sys.executable, "-m", "lmforge", "train"]
        out = self.out / "runs" / spec.name
        proc = self.sub(row, base + self.train_args(a["steps"]) + list(a.get("extra", ())) +
                        ["--train.out_dir", str(out), "--checkpoint.resume", "none"], check=False)
        said = proc.stderr + proc.stdout
        backend = re.search(r"ranks, backend (\S+),", said)
        if spec.name == "async-2" and proc.returncode and "Duplicate GPU" in said:
            raise RowFailed("limitation: NCCL refused two ranks on one GPU (Duplicate GPU) although the default "
                            "group should be gloo here; see async-2.log")
        if proc.returncode:
            raise RowFailed(f"exit {proc.returncode}: {last_line(proc)}")
        s = json.loads((out / "summary.json").read_text())
        row.detail = {k: s.get(k) for k in ("val_loss", "initial_val_loss", "tokens_per_second", "mfu", "peak_mem_gb",
                                            "layout", "steps")}
        row.result = (f"{s.get('layout', '?')}: val loss {s['initial_val_loss']:.3f} -> {s['val_loss']:.3f}, "
                      f"{s['tokens_per_second']:,.0f} tok/s (whole run), peak {s.get('peak_mem_gb', 0):.2f} GB")
        fp8 = re.search(r"fp8: \d+ block linears converted[^\n]*", said)
        if fp8:
            row.result += f"; {fp8.group(0)}"
        if spec.name == "async-2":
            row.detail["backend"] = backend.group(1) if backend else None
            row.result += f"; default group {row.detail['backend']}, parameter server messages on gloo"

    def throughput_json(self, row: Row, preset: str, sets, reference: bool, profile: bool, name: str = "") -> dict:
        """One benchmarks/train_throughput.py run; its JSON."""
        out = self.out / f"{name or row.step}.json"
        cmd = [sys.executable, str(BENCH / "train_throughput.py"), "--preset", preset, "--json", str(out)]
        cmd += [a for s in sets for a in ("--set", s)]
        cmd += ["--profile", str(self.out / f"{row.step}-profile.md")] if profile else []
        cmd += ([] if reference else ["--no-reference"]) + ([] if self.cuda else ["--quick"])
        self.sub(row, cmd)
        return json.loads(out.read_text())

    def step_throughput(self, spec: RowSpec, row: Row) -> None:
        """tokens/s and MFU (benchmarks/train_throughput.py); on a GPU, peak memory against the plan."""
        a = spec.args
        if a.get("needs"):
            self.needs(a["needs"])
        res = self.throughput_json(row, a["preset"], a["sets"], a["reference"], a["profile"])
        arm = res["arms"]["lmforge"]
        plan = planned_memory_gb(res)
        row.detail = {"tokens_per_s": arm["tokens_per_s_median"], "mfu": arm["mfu"], "peak_mem_gb": arm["peak_mem_gb"],
                      "planned_gb": plan, "ratios": res.get("paired_ratios", {})}
        mfu = f"{100 * arm['mfu']:.1f}% MFU" if arm.get("mfu") is not None else "MFU n/a"
        mem = (f"; peak {arm['peak_mem_gb']:.2f} GB vs plan (lmforge) {plan:.2f} GB"
               if plan and not a["reference"] and self.cuda else "")
        ratio = "".join(f"; {k} {v:.3f}" for k, v in res.get("paired_ratios", {}).items())
        row.result = f"{arm['tokens_per_s_median']:,.0f} tok/s, {mfu}{mem}{ratio}"
        against = self.out / f"{a.get('against', '')}.json"
        if a.get("against") and against.is_file():  # (the row it is measured against ran before it)
            other = json.loads(against.read_text())["arms"]["lmforge"]
            ratio = arm["tokens_per_s_median"] / other["tokens_per_s_median"]
            row.detail["over_" + a["against"]] = ratio
            row.result += f"; {ratio:.2f}x the tokens/s of {a['against']}"
            if other.get("mfu") is not None and arm.get("mfu") is not None:
                row.result += f" ({100 * arm['mfu']:.1f}% vs {100 * other['mfu']:.1f}% MFU)"
        if a.get("check") == "compile_choice":
            self.check_compile_choice(row)

    def step_head_loss(self, spec: RowSpec, row: Row) -> None:
        """Plain head + cross-entropy against the fused, chunked one (benchmarks/fused_head.py), and
        whether train.loss_chunk = "auto" picks the faster: on the GPU this row decides the rule (it
        fails, naming the fix, where auto picks the slower; within 2% counts as not slower)."""
        out = self.out / "head-loss.json"
        shape = (["--device", "cuda", "--precision", "bf16", "--tokens", "16384", "--steps", "5", "--rounds", "2"]
                 if self.cuda else ["--precision", "fp32", "--tokens", "512", "--vocab", "8192", "--dim", "64",
                                    "--chunk", "128", "--steps", "1", "--rounds", "1"])
        self.sub(row, [sys.executable, str(BENCH / "fused_head.py"), "--json", str(out)] + shape)
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
            raise RowFailed(row.result + f"; but {faster} is faster here: change lmforge.config.rules."
                            f"resolve_loss_chunk's rule for {r['precision']} on CUDA and record it in benchmarks/RESULTS.md")

    def check_compile_choice(self, row: Row) -> None:
        """gpt2-compile against gpt2-plain (both loss_chunk 0; compile on / off): the measured speed-up
        of per-block torch.compile, and whether train.compile = "auto" (on on CUDA:
        lmforge.config.rules.resolve_compile) picks the faster; the row fails, naming the fix, where
        it does not (within 2% counts as not slower)."""
        tps = {}
        for name in ("gpt2-plain", "gpt2-compile"):
            f = self.out / f"{name}.json"
            if f.is_file():
                tps[name] = json.loads(f.read_text())["arms"]["lmforge"]["tokens_per_s_median"]
        if row.status != "ok" or len(tps) < 2:
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

    def step_fp8_config(self, spec: RowSpec, row: Row) -> None:
        """On the CPU: torchao.float8 imports and the fp8 config loads (fp8 itself needs a GPU)."""
        self.needs("torchao.float8")
        code = ("import torchao.float8; from lmforge.config import load_config; "
                "c = load_config('gpt2-124m', {'train.fp8': True, 'train.device': 'cuda'}); print('fp8 config loads')")
        self.sub(row, [sys.executable, "-c", code])
        row.result = "torchao.float8 imports; the gpt2-124m fp8 config loads"

    def step_optim(self, spec: RowSpec, row: Row) -> None:
        """tests/test_optim_cuda.py: the fused / foreach optimizers on the device (nothing skipped on a GPU)."""
        proc = self.sub(row, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              str(ROOT / "tests" / "test_optim_cuda.py")])
        row.result = (proc.stdout.strip().splitlines() or [""])[-1][:160]
        if "skipped" in row.result and self.cuda:
            raise RowFailed(row.result + " (on a GPU nothing may be skipped)")

    def step_ckpt_save(self, spec: RowSpec, row: Row) -> None:
        """Checkpoint saves from the device (benchmarks/checkpoint_save.py, which exits 1 if any save
        failed or was not validated): the median over saves 2-3 (the first allocates the staging
        buffers) of the time the loop blocks and of the time to a validated checkpoint, per mode, and
        the staging the manager chose (lmforge.ckpt.manager.device_stager)."""
        out = self.out / "ckpt-save.json"
        preset, how = (("gpt2-124m", ["--device", "cuda", "--modes", "async,async-per-save"]) if self.cuda else
                       ("tiny", ["--device", "cpu", "--modes", "async,sync", "--staging", "dcp"]))
        self.sub(row, [sys.executable, str(BENCH / "checkpoint_save.py"), "--preset", preset, "--reps", "3",
                       "--json", str(out), *how])
        saves = [r for r in json.loads(out.read_text()) if r["rep"] > 0]
        parts = []
        for mode in dict.fromkeys(r["mode"] for r in saves):
            sel = [r for r in saves if r["mode"] == mode]
            blocking = sorted(r["blocking_s"] for r in sel)[len(sel) // 2]
            total = sorted(r["total_s"] for r in sel)[len(sel) // 2]
            row.detail[mode] = {"blocking_s": blocking, "total_s": total, "staging": sel[0]["staging"] or "host copy"}
            how = f" ({row.detail[mode]['staging']})" if mode.startswith("async") else ""
            parts.append(f"{mode}{how}: blocks {blocking:.3f} s, validated {total:.2f} s")
        row.result = (f"{preset}, {saves[0]['bytes'] / 1e6:,.1f} MB a save, every save validated; "
                      + "; ".join(parts))

    def script_json(self, row: Row, script: str, how: list[str]) -> tuple[subprocess.CompletedProcess, dict]:
        """benchmarks/<script> --json OUT/<row>.json: the process and its JSON, which it writes whether
        or not its check passed (no JSON: the row fails with the script's last line)."""
        out = self.out / f"{row.step}.json"
        proc = self.sub(row, [sys.executable, str(BENCH / script), "--json", str(out), *how], check=False)
        if not out.is_file():
            raise RowFailed(f"exit {proc.returncode}: {last_line(proc)}")
        return proc, json.loads(out.read_text())

    def step_resume(self, spec: RowSpec, row: Row) -> None:
        """N straight steps vs N/2 + resume + N/2 (benchmarks/resume_parity.py): max |weight diff|."""
        how = (["--device", "cuda", "--precision", "bf16", "--steps", "40"] if self.cuda else
               ["--device", "cpu", "--precision", "fp32", "--steps", "8", "--small"])
        _, r = self.script_json(row, "resume_parity.py", how)
        row.detail = r
        half = r["steps"] // 2
        if r["identical"]:
            row.result = (f"{r['steps']} straight steps == {half} + resume + {half}, {r['precision']}: bit-identical "
                          f"({r['tensors']} tensors, max abs diff 0)")
            return
        raise RowFailed(f"{r['steps']} straight vs {half} + resume + {half}, {r['precision']}: {r['differing']} of "
                        f"{r['tensors']} tensors differ, max abs diff {r['max_abs_diff']:.3g} ({r['worst_tensor']}); "
                        f"first step whose loss differs: {r['first_step_loss_differs']}; ops without a deterministic "
                        f"kernel: {', '.join(r['nondeterministic_ops']) or 'none reported'}")

    def step_families(self, spec: RowSpec, row: Row) -> None:
        """Llama-3.1 / Qwen2.5 / Qwen3 / Qwen3-Next / Gemma 3 / OLMo 3 shapes, 20 steps, chunked validation at vocab
        8192 (family_shapes.py)."""
        how = (["--device", "cuda", "--precision", "bf16", "--steps", "20"] if self.cuda else
               ["--device", "cpu", "--precision", "fp32", "--steps", "4", "--small"])
        proc, res = self.script_json(row, "family_shapes.py", how)
        fams = res["families"]
        row.detail = {f["family"]: f for f in fams}
        row.result = "; ".join(
            f"{f['family']} ({f['option']}{', ' + f['deltanet_kernel'] + ' kernels' if f.get('deltanet_kernel') else ''}"
            f"): val {f['initial_val_loss']:.2f} -> {f['val_loss']:.2f}, chunk "
            f"{f['loss_chunk']} vs plain: abs diff {f['chunked_vs_plain']:.1e}, {f['tokens_per_second']:,.0f} tok/s"
            + ("" if f["ok"] else " FAILED: " + ", ".join(f["problems"])) for f in fams)
        if proc.returncode or not all(f["ok"] for f in fams):
            raise RowFailed(row.result)

    def step_moe(self, spec: RowSpec, row: Row) -> None:
        """MoE experts in the run's 16-bit dtype: benchmarks/moe_grouped_gemm.py (--device --dtype:
        grouped_mm forced on, the padded fallback, the per-expert loop), then a train_throughput.py run
        with model.moe.grouped_mm = auto, which prints the path its experts took."""
        script = BENCH / "moe_grouped_gemm.py"
        flags = re.findall(r"add_argument\(\s*\"(--[\w-]+)\"[^)]*", script.read_text())
        if not {"--device", "--dtype"} <= set(flags):
            raise RowFailed("benchmarks/moe_grouped_gemm.py has no --device / --dtype options (issue 42 item 3 adds "
                            "them); this row cannot measure the experts on the device")
        dtype_line = next(m for m in re.findall(r"add_argument\(\s*\"--dtype\"[^)]*\)", script.read_text()))
        bf16 = "bfloat16" if "bfloat16" in dtype_line and "\"bf16\"" not in dtype_line else "bf16"
        shape = (["--device", "cuda", "--dtype", bf16, "--tokens", "16384", "--experts", "8", "64", "--dim", "1024",
                  "--hidden", "1024", "--reps", "10"] if self.cuda else
                 ["--device", "cpu", "--dtype", "fp32" if "bf16" == bf16 else "float32", "--tokens", "256",
                  "--experts", "4", "--dim", "32", "--hidden", "64", "--reps", "2"])
        proc = self.sub(row, [sys.executable, str(script), *shape])
        kernels = read_moe_table(proc.stdout, int(shape[shape.index("--tokens") + 1]))
        if not kernels:
            raise RowFailed("could not read moe_grouped_gemm.py's table (columns naming grouped_mm and loop): see "
                            "moe-bf16.log")
        sets = (("train.precision=bf16", "train.compile=false", "model.moe.grouped_mm=auto", "model.dim=512",
                 "model.n_heads=8", "model.moe.expert_hidden=1024", "model.max_seq_len=512", "data.seq_len=512",
                 "train.micro_batch_size=16", "train.global_batch_size=16") if self.cuda else
                ("train.compile=false", "model.moe.grouped_mm=auto", *rowdefs.CPU_SMOKE_BATCH))
        res = self.throughput_json(row, "tiny-moe", sets, reference=False, profile=False, name="moe-bf16-train")
        path = res.get("moe_path", {})
        arm = res["arms"]["lmforge"]
        row.detail = {"kernels": kernels, "train_tokens_per_s": arm["tokens_per_s_median"], "train_path": path}
        row.result = "; ".join(
            f"{k['experts']} experts: grouped_mm {k['grouped_tok_s']:,.0f} vs loop {k['loop_tok_s']:,.0f} tok/s "
            f"({k['grouped_tok_s'] / k['loop_tok_s']:.2f}x" + (f", auto takes {k['auto_path']})" if k["auto_path"]
                                                                else ")") for k in kernels)
        row.result += (f"; training ({res['config']['precision']}, grouped_mm auto): {arm['tokens_per_s_median']:,.0f} "
                       f"tok/s, experts took {path.get('path', '?')} ({path.get('grouped_mm_calls', '?')} grouped_mm "
                       f"calls a step)")
        if self.cuda and path.get("path") != "grouped_mm":
            raise RowFailed(row.result + "; model.moe.grouped_mm = auto did not take torch._grouped_mm in bf16 on CUDA")

    def step_peer(self, spec: RowSpec, row: Row) -> None:
        """A peer (benchmarks/gpu/peers.py) at the shape of the lmforge row `shape_of`, on that row's
        tokens, in this call: its own step time and tokens/s, and lmforge / peer for each lmforge row
        of `against` that ran before it (the issue's target, `target`, read on the GPU)."""
        import peers  # (benchmarks/gpu/peers.py)
        from train_throughput import QUICK_OVERRIDES, parse_sets, synthetic_tokens
        from lmforge.config import load_config

        a, name = spec.args, spec.args["peer"]
        repo = peers.PEERS[name].repo
        folder = Path(self.args.peers) / name if getattr(self.args, "peers", "") else None
        if folder is None or not (folder / "COMMIT").is_file():
            raise RowSkipped(f"no {repo} in the window: `suite.py --prepare DIR --{name} PATH` copies it from a local "
                             f"checkout, and the device command passes --peers DIR/peers (benchmarks/gpu/README.md)")
        like = {r.name: r for r in rowdefs.ROWS}[a["shape_of"] if self.cuda else "throughput-quick"]
        overrides = {**({} if self.cuda else QUICK_OVERRIDES), **parse_sets(list(like.args["sets"]))}
        cfg = load_config(like.args["preset"], overrides)
        shape = peers.shape_of(cfg, self.cuda)
        tokens = synthetic_tokens(shape.vocab, shape.tokens_per_step, cfg.train.seed)
        run_dir = self.out / "runs" / spec.name
        steps, skip = (25, 5) if self.cuda else (6, 2)
        try:
            if name == "llmc":
                if not self.cuda:
                    raise RowSkipped("llm.c's train_gpt2cu needs CUDA; the CPU smoke has none")
                if not shutil.which("nvcc"):
                    raise RowSkipped("no nvcc on this machine: llm.c's train_gpt2cu cannot be built here")
                peers.llmc_check(shape)
                shutil.copytree(folder, run_dir, dirs_exist_ok=True)
                for split in ("train", "val"):
                    peers.write_llmc_tokens(run_dir / "data" / f"{split}.bin", tokens[split])
                build, run = peers.llmc_commands(shape, steps)
                self.sub(row, build, cwd=run_dir)
                proc = self.sub(row, run, cwd=run_dir)
                got = peers.steady(peers.read_steps(proc.stdout, peers.LLMC_STEP), skip, shape)
            else:
                peers.write_nanogpt_run(folder, run_dir, shape, tokens["train"], tokens["val"])
                # (on the CPU, one thread: as throughput-quick's --quick, which it is read against)
                env = self.env if self.cuda else {**self.env, "OMP_NUM_THREADS": "1"}
                proc = self.sub(row, peers.nanogpt_command(sys.executable, shape, steps), cwd=run_dir, env=env)
                got = peers.steady(peers.read_steps(proc.stdout, peers.NANOGPT_ITER), skip, shape)
        except peers.PeerError as e:
            raise RowFailed(f"{repo}: {e}") from None
        commit = peers.peer_commit(folder)
        row.detail = {"peer": repo, "commit": commit, "shape": shape.__dict__, "like": like.name, **got}
        row.result = (f"{repo} {commit[:7]} at {like.name}'s shape ({shape.n_layer} layers x {shape.dim}, "
                      f"{shape.micro} x {shape.seq} x {shape.accum} tokens a step, {shape.dtype}"
                      f"{', compiled' if shape.cuda and name == 'nanogpt' else ''}): {got['tokens_per_s']:,.0f} tok/s "
                      f"({got['step_ms_median']:.1f} ms a step, median of {got['steps_timed']}), loss "
                      f"{got['first_loss']:.2f} -> {got['last_loss']:.2f}")
        ratios = {}
        for other in (a["against"] if self.cuda else ("throughput-quick",)):
            f = self.out / f"{other}.json"
            if f.is_file():
                res = json.loads(f.read_text())
                ratios[other] = res["arms"]["lmforge"]["tokens_per_s_median"] / got["tokens_per_s"]
                if not row.detail.get("mfu") and res.get("peak_flops", {}).get("run"):
                    row.detail["mfu"] = got["tokens_per_s"] * res["config"]["flops_per_token"] / res["peak_flops"]["run"]
        row.detail["lmforge_over_peer"] = ratios
        if row.detail.get("mfu"):
            row.result += f", {100 * row.detail['mfu']:.1f}% MFU (lmforge's count and peak)"
        if not ratios:
            row.result += "; no lmforge row of this shape ran before it in this call: nothing to compare"
            return
        row.result += "; lmforge / peer: " + ", ".join(f"{k} {v:.3f}x" for k, v in ratios.items())
        if self.cuda and a.get("target"):
            best = max(ratios, key=ratios.get)
            row.result += (f"; target {a['target']:.2f}x: {'met' if ratios[best] >= a['target'] else 'missed'} "
                           f"(best: {best})")

    # ---- the record ----------------------------------------------------------------------------
    def record(self) -> dict:
        return {"mode": rowdefs.mode_key(self.cuda), "device": self.device_name,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": git_commit(),
                "command": " ".join(sys.argv), "budget_min": self.args.budget_min,
                "rows": [r.__dict__ for r in self.rows]}

    def save(self) -> None:
        """Write the table and the JSON as they stand (after every row and at the end)."""
        (self.out / "gpu_suite.md").write_text(self.table())
        (self.out / "gpu_suite.json").write_text(json.dumps(self.record(), indent=1, default=str))

    def table(self) -> str:
        used = time.monotonic() - self.started
        head = [f"# lmforge GPU suite — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
                f"machine: {platform.node()}, {platform.platform()}, {self.device_name}; commit {git_commit()}; "
                f"command: {' '.join(sys.argv)}", f"{used:.0f} s of the {self.args.budget_min:g}-minute budget used",
                "", "| step | status | result | seconds | expected |", "|---|---|---|---|---|"]
        return "\n".join(head + [f"| {r.step} | {r.status}{'' if r.required else ' (optional)'} | "
                                 f"{r.result.replace('|', '/')} | {r.seconds:.0f} | {r.expected_s:.0f} |"
                                 for r in self.rows]) + "\n"

    def passed(self) -> bool:
        """Only a failed required row fails the suite (a skipped row never does)."""
        return all(r.status != "failed" for r in self.rows if r.required)


def last_line(proc: subprocess.CompletedProcess) -> str:
    return (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or [""])[-1][:200]


def read_moe_table(text: str, tokens: int) -> list[dict]:
    """moe_grouped_gemm.py's markdown table -> per expert count, tokens/s of grouped_mm and of the loop
    (columns found by their names, so added columns do not break it)."""
    lines = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in text.splitlines() if ln.startswith("|")]
    if not lines:
        return []
    head = [h.lower() for h in lines[0]]
    col = lambda word: next((i for i, h in enumerate(head) if word in h and "/" not in h), None)  # noqa: E731
    experts, grouped, loop, auto = col("experts"), col("grouped"), col("loop"), col("auto")
    if None in (experts, grouped, loop):
        return []
    out = []
    for cells in lines[1:]:
        try:
            ms_g, ms_l = float(cells[grouped]), float(cells[loop])
            out.append({"experts": int(cells[experts]), "grouped_ms": ms_g, "loop_ms": ms_l,
                        "grouped_tok_s": tokens / (ms_g / 1e3), "loop_tok_s": tokens / (ms_l / 1e3),
                        "auto_path": cells[auto] if auto is not None else None})
        except (ValueError, IndexError):
            continue  # (the |---| line, or a row that is not numbers)
    return out


def install_wheels(folder: Path) -> str:
    """DIR/*.whl into a private folder (no index, no dependencies); its path for PYTHONPATH. With pip
    where the machine's Python has it; else each wheel is unpacked (a wheel is a zip whose root is
    what goes on the path: PEP 427), which is all a pure or prebuilt wheel without scripts needs."""
    site = Path(tempfile.mkdtemp(prefix="lmforge-wheels-"))
    wheels = sorted(str(w) for w in folder.glob("*.whl"))
    if wheels:
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                               "--target", str(site), *wheels], capture_output=True, text=True)
        if proc.returncode:
            import zipfile

            print(f"pip install failed ({last_line(proc)}); unpacking the wheels instead", file=sys.stderr)
            for w in wheels:
                zipfile.ZipFile(w).extractall(site)
    return str(site)


def git_commit() -> str:
    """HEAD's short hash, "+ changes" where the tree differs from it (the device tool's copy keeps the
    last landed commit as HEAD under the session's working tree)."""
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    head = proc.stdout.strip() or "unknown"
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                             text=True, cwd=ROOT).stdout.strip()
    return f"{head} + changes" if head != "unknown" and changed else head


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="folder for the table (gpu_suite.md), the JSON and the logs")
    p.add_argument("--rows", default="", help="comma-separated rows, run in that order (default: every row, in the "
                                              "default order; --dry-run lists them)")
    p.add_argument("--dry-run", action="store_true", help="print the plan (rows, expected seconds, total) and exit")
    p.add_argument("--budget-min", type=float, default=9.0,
                   help="minutes for the rows (default 9: the lent machine gives 15 minutes of device time in all, "
                        "start-up included, and at most 10 a command); a row whose expected time does not fit what "
                        "is left is skipped")
    p.add_argument("--wheels", default="", help="folder of wheels to install privately first (no index, no deps)")
    p.add_argument("--cache", default="", help="a copy of ~/.cache/lmforge (the default corpus, prepared)")
    p.add_argument("--cpu-smoke", action="store_true", help="the same rows, tiny, on the CPU (tests the suite)")
    p.add_argument("--limit-scale", type=float, default=1.0,
                   help="multiply every row's expected time and limit (a CPU shared with other jobs runs the smoke "
                        "slowly)")
    p.add_argument("--prepare", default="", metavar="DIR",
                   help="on a connected machine: the cache and the wheels into DIR (inside this tree), then print "
                        "the device `run` command that uses them")
    p.add_argument("--find-links", default="", help="--prepare: take the wheels from this folder, no index")
    p.add_argument("--nanogpt", default="", metavar="PATH",
                   help="--prepare: copy nanoGPT's train.py, model.py, configurator.py from this local checkout (or bare "
                        "git directory) into DIR/peers (the peer-nanogpt row)")
    p.add_argument("--llmc", default="", metavar="PATH",
                   help="--prepare: copy llm.c's train_gpt2.cu, Makefile and llmc/ from this local checkout into "
                        "DIR/peers (the peer-llmc row, where the device has nvcc)")
    p.add_argument("--peers", default="", metavar="DIR",
                   help="the peers --prepare copied (DIR/peers): the peer rows run them; without it they are skipped")
    p.add_argument("--build-cache", default="", metavar="CACHE",
                   help="on a connected machine: write the --cache folder only and exit")
    p.add_argument("--record-times", default="", metavar="GPU_SUITE_JSON",
                   help="store a run's measured seconds (its gpu_suite.json) as the rows' expected seconds")
    args = p.parse_args(argv)
    import prepare  # noqa: E402  (benchmarks/gpu/prepare.py)

    if args.prepare:
        return prepare.prepare(Path(args.prepare), args.find_links, args.budget_min,
                               {"nanogpt": args.nanogpt, "llmc": args.llmc})
    if args.build_cache:
        prepare.build_cache(Path(args.build_cache))
        return 0
    if args.record_times:
        for line in rowdefs.record_times(Path(args.record_times)):
            print(line)
        print(f"written: {rowdefs.EXPECTED_FILE}")
        return 0
    try:
        specs = rowdefs.select(args.rows, cuda=not args.cpu_smoke)
    except ValueError as e:
        p.error(str(e))
    if args.dry_run:
        print(rowdefs.plan(specs, not args.cpu_smoke, 60 * args.budget_min).text(not args.cpu_smoke))
        return 0
    if not args.out:
        p.error("--out is required (or --dry-run, --prepare DIR, --build-cache CACHE, --record-times JSON)")
    suite = Suite(args)
    suite.run_rows(specs)
    suite.save()
    print(suite.table())
    return 0 if suite.passed() else 1


if __name__ == "__main__":
    sys.exit(main())
