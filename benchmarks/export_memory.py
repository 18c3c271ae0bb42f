"""Benchmark (not a test): peak memory and time of `unispec export` against checkpoint size and depth.

    .venv/bin/python benchmarks/export_memory.py [--cases 1b,ds-4l,8b-eagle3:int4] [--work DIR] [--json]
        [--dtype bfloat16] [--checkpoint-dtype bfloat16] [--keep-artifacts] [--peer]

Each case writes a random-weight checkpoint in code (bf16 safetensors, the real config fields incl.
llama3 RoPE scaling; keys and shapes from transformers' own classes built on the meta device, so nothing
but one tensor at a time is ever in memory), runs `unispec export` in a child process and reads that
child's peak RSS, wall and CPU time from `os.wait4`. Checkpoints and artifacts live under --work and are
removed after each case.

  1b / 3b / 8b   Llama 3.2 1B, 3.2 3B, 3.1 8B shapes, method none
  *-eagle3       the same target + an Eagle3 head of its shape (one MHA layer, draft vocab 32000)
  ds-4l / ds-61l DeepSeek-V3 shape at depth 4 / 61 (first 3 dense, MoE after, MLA; widths reduced) +
                 its MTP layer; method none (ds-*-mtp: method mtp)
  <case>:int4    the same, exported with `--quantize int4` (or :int8): weights quantized one at a time

--dtype is the export's (bfloat16: every weight a zero-copy view of the checkpoint; ONNX Runtime's CPU
provider runs float16 / float32 only, so an artifact meant to run there takes --dtype float16 with
--checkpoint-dtype float16: a cast would copy every weight). The budget is issue 36's: 0.25 x checkpoint
+ 1.5 GB for 8B shapes, 0.4 x checkpoint + 1.5 GB otherwise. --keep-artifacts keeps each artifact (the
checkpoints still go) for `unispec inspect` / `unispec run`. --peer also runs onnxruntime-genai's builder on each
Llama checkpoint at the export's precision (int4 block 32, or fp32), for its wall time and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
UNISPEC = ROOT / ".venv" / "bin" / "unispec"
SHARD_BYTES = 5 * 2**30         # Hugging Face's default shard size
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
LLAMA_COMMON = dict(vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                    rope_scaling=LLAMA3_ROPE, bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16")
LLAMAS = {
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               head_dim=64, intermediate_size=8192, tie_word_embeddings=True),
    "3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
               head_dim=128, intermediate_size=8192, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, intermediate_size=14336, tie_word_embeddings=False),
}
# DeepSeek-V3's structure (61 layers, first 3 dense, MLA, grouped routing, YaRN) with widths cut so that a
# 61-layer checkpoint stays a few GB: the depth is what the benchmark measures.
DEEPSEEK_V3 = dict(
    vocab_size=129280, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256,
    num_attention_heads=16, num_key_value_heads=16, first_k_dense_replace=3, n_routed_experts=16,
    n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
    kv_lora_rank=128, q_lora_rank=384, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
    max_position_embeddings=163840, rms_norm_eps=1e-6, num_nextn_predict_layers=1, tie_word_embeddings=False,
    rope_theta=10000.0, torch_dtype="bfloat16",
    rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                  "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
)
EAGLE3_DRAFT_VOCAB = 32000
BUDGET_PER_CHECKPOINT = {"8b": 0.25}          # issue 36; other shapes 0.4
CHECKPOINT_DTYPES = {"bfloat16": (torch.bfloat16, "BF16"), "float16": (torch.float16, "F16")}


@dataclass(frozen=True)
class Case:
    name: str
    family: str          # "llama" | "deepseek"
    shape: str           # LLAMAS key, or the DeepSeek depth
    method: str
    eagle3: bool = False
    quantize: str = "none"


def parse_case(name: str) -> Case:
    shape, _, quantize = name.partition(":")
    if quantize not in ("", "int4", "int8"):
        raise SystemExit(f"unknown quantization {quantize!r} in case {name!r}: use :int4 or :int8")
    quantize = quantize or "none"
    base, _, suffix = shape.partition("-")
    if base in LLAMAS and suffix in ("", "eagle3"):
        return Case(name, "llama", base, "eagle3-mha" if suffix else "none", eagle3=bool(suffix), quantize=quantize)
    deepseek = re.fullmatch(r"ds-(\d+)l(-mtp)?", shape)
    if deepseek:
        return Case(name, "deepseek", deepseek[1], "mtp" if deepseek[2] else "none", quantize=quantize)
    raise SystemExit(f"unknown case {name!r}: use 1b, 3b, 8b (optionally -eagle3) or ds-<layers>l[-mtp], "
                     "each optionally :int4 or :int8")


# --- checkpoints ----------------------------------------------------------------------------------------------

def meta_shapes(model_class: type, config: Any) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the model's state dict, built without allocating a weight."""
    with torch.device("meta"):
        model = model_class(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def random_chunks(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype) -> Iterator[bytes]:
    """`dtype` bytes of a random tensor, ~64 MiB of float32 at a time; norms (1-D) around 1, weights around 0."""
    rows = shape[0] if shape else 1
    width = max(1, int(torch.tensor(shape[1:]).prod())) if len(shape) > 1 else 1
    step = max(1, (16 * 2**20) // width)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        chunk = torch.randn((n, width), generator=gen) * 0.02 + (1.0 if len(shape) == 1 else 0.0)
        yield chunk.to(dtype).view(torch.uint8).numpy().tobytes()


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], gen: torch.Generator,
                      dtype: str = "bfloat16") -> None:
    """One safetensors file, streamed tensor by tensor (header first: every size is known from the shape)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, shape in shapes.items():
        size = 2 * int(torch.tensor(shape).prod()) if shape else 2
        header[key] = {"dtype": CHECKPOINT_DTYPES[dtype][1], "shape": list(shape),
                       "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(blob)) + blob)
        for shape in shapes.values():
            for chunk in random_chunks(shape, gen, CHECKPOINT_DTYPES[dtype][0]):
                out.write(chunk)


def dtype_of(config: dict[str, Any]) -> str:
    """The checkpoint dtype a config names (transformers 5 writes `dtype`, older ones `torch_dtype`)."""
    return str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")


def write_checkpoint(out: Path, config: dict[str, Any], shapes: dict[str, tuple[int, ...]], seed: int) -> int:
    """config.json + shards of <= SHARD_BYTES (+ index when more than one); returns the weight bytes."""
    out.mkdir(parents=True)
    dtype = dtype_of(config)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = torch.Generator().manual_seed(seed)
    shards: list[dict[str, tuple[int, ...]]] = [{}]
    size = total = 0
    for key, shape in sorted(shapes.items()):
        nbytes = 2 * int(torch.tensor(shape).prod())
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][key] = shape
        size += nbytes
        total += nbytes
    if len(shards) == 1:
        write_safetensors(out / "model.safetensors", shards[0], gen, dtype)
        return total
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        write_safetensors(out / name, shard, gen, dtype)
    index = {"metadata": {"total_size": total}, "weight_map": {k: n for n, s in zip(names, shards) for k in s}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def llama_checkpoint(out: Path, shape: str, dtype: str = "bfloat16") -> tuple[dict[str, Any], int]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**LLAMA_COMMON, "torch_dtype": dtype}, **LLAMAS[shape])
    shapes = meta_shapes(LlamaForCausalLM, config)
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    hf = {**config.to_dict(), "architectures": ["LlamaForCausalLM"]}
    return hf, write_checkpoint(out, hf, shapes, seed=1)


def deepseek_checkpoint(out: Path, depth: int) -> tuple[dict[str, Any], int]:
    """The target's `depth` layers + DeepSeek's MTP block at model.layers.{depth} (as the official files)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    shapes = meta_shapes(DeepseekV3ForCausalLM, DeepseekV3Config(**{**DEEPSEEK_V3, "num_hidden_layers": depth + 1}))
    h, p = DEEPSEEK_V3["hidden_size"], f"model.layers.{depth}."
    shapes |= {p + "enorm.weight": (h,), p + "hnorm.weight": (h,), p + "eh_proj.weight": (h, 2 * h),
               p + "shared_head.norm.weight": (h,), p + "embed_tokens.weight": shapes["model.embed_tokens.weight"],
               p + "shared_head.head.weight": shapes["lm_head.weight"]}
    config = DeepseekV3Config(**{**DEEPSEEK_V3, "num_hidden_layers": depth})
    hf = {**config.to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}
    return hf, write_checkpoint(out, hf, shapes, seed=2)


def eagle3_checkpoint(out: Path, target: dict[str, Any]) -> int:
    """An MHA Eagle3 head of the target's shape (SpecForge `midlayer.*` keys, pruned draft vocabulary)."""
    h, heads, kv, d = (target[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    inner, p = target["intermediate_size"], "midlayer."
    shapes = {"fc.weight": (h, 3 * h), "norm.weight": (h,), "lm_head.weight": (EAGLE3_DRAFT_VOCAB, h),
              **{f"{p}{n}.weight": (h,) for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")},
              p + "self_attn.q_proj.weight": (heads * d, 2 * h), p + "self_attn.k_proj.weight": (kv * d, 2 * h),
              p + "self_attn.v_proj.weight": (kv * d, 2 * h), p + "self_attn.o_proj.weight": (h, heads * d),
              p + "mlp.gate_proj.weight": (inner, h), p + "mlp.up_proj.weight": (inner, h),
              p + "mlp.down_proj.weight": (h, inner)}
    layers = target["num_hidden_layers"]
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
              "hidden_size": h, "intermediate_size": inner, "num_attention_heads": heads, "num_key_value_heads": kv,
              "head_dim": d, "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "vocab_size": target["vocab_size"],
              "max_position_embeddings": target["max_position_embeddings"], "draft_vocab_size": EAGLE3_DRAFT_VOCAB,
              "tie_word_embeddings": False, "torch_dtype": dtype_of(target),
              # transformers 5 writes the target's RoPE as rope_parameters: the head gets the same fields
              "rope_theta": LLAMA_COMMON["rope_theta"], "rope_scaling": LLAMA_COMMON["rope_scaling"],
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, layers // 2, layers - 3],
                               "use_aux_hidden_state": True}}
    from safetensors.torch import save_file

    size = write_checkpoint(out, config, shapes, seed=3)
    # without model.safetensors every *.safetensors file is read: weights + the int vocabulary map
    (out / "model.safetensors").rename(out / "eagle3.safetensors")
    t2d = torch.zeros(target["vocab_size"], dtype=torch.bool)
    t2d[:EAGLE3_DRAFT_VOCAB] = True                       # the first ids kept: d2t all zero
    save_file({"d2t": torch.zeros(EAGLE3_DRAFT_VOCAB, dtype=torch.int64), "t2d": t2d},
              str(out / "vocab.safetensors"), metadata={"format": "pt"})
    return size


# --- runs -----------------------------------------------------------------------------------------------------

def run_export(target: Path, draft: Path | None, case: Case, out: Path, dtype: str) -> dict[str, Any]:
    """`unispec export` in a child process: its peak RSS (KiB from wait4), wall and CPU seconds, and the peak
    RSS / anonymous / file-backed memory of each export stage (/proc polled while its progress lines come)."""
    command = [str(UNISPEC), "export", "--target", str(target), "--method", case.method, "--dtype", dtype,
               "--quantize", case.quantize, "--out", str(out)] + (["--draft", str(draft)] if draft else [])
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []

    def read() -> None:                      # stage lines echoed as they come: a long case shows progress
        for line in child.stderr or ():
            lines.append(line)
            print(f"  {case.name}: {line.rstrip()}", file=sys.stderr, flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    stages: dict[str, dict[str, float]] = {}
    pending: dict[str, float] = {}
    while True:
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)     # wait4, not poll: it brings the rusage
        if pid:
            break
        done = [line for line in lines if line.startswith("[export]")]
        for line in done[len(stages):]:          # a stage's line comes when it ends: close its bucket
            stages[line[len("[export]"):].split("  ")[0].strip()] = pending
            pending = {}
        for key, value in memory_gb(child.pid).items():
            pending[key] = max(pending.get(key, 0.0), value)
        time.sleep(0.2)
    reader.join()
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"export failed: {''.join(lines)[-2000:]}")
    return {"peak_rss_gb": usage.ru_maxrss * 1024 / 1e9, "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "stages": stages}


def run_peer(target: Path, case: Case, out: Path) -> dict[str, Any]:
    """onnxruntime-genai's model builder on the same checkpoint, in a child process, at the export's precision
    (`--quantize int4` -> its int4, block 32, symmetric; none -> fp32, as unispec bench's peer): its peak RSS
    (wait4) and wall time."""
    from unispec.bench_peers import genai_build_command, genai_precision

    bits = {"none": None, "int4": 4, "int8": 8}[case.quantize]
    precision = genai_precision(None if bits is None else {"method": "rtn", "bits": bits, "block_size": 32,
                                                           "symmetric": True})
    for name in ("tokenizer.json", "tokenizer_config.json"):     # the builder needs one; the weights are random
        if not (target / name).exists():
            shutil.copy(ROOT / "models" / "llama3" / name, target / name)
    log = out.parent / "peer.log"
    start = time.perf_counter()
    with open(log, "w") as stderr:
        child = subprocess.Popen(genai_build_command(target, out, precision), stdout=subprocess.DEVNULL,
                                 stderr=stderr)
        _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"onnxruntime-genai's builder failed: {log.read_text()[-2000:]}")
    return {"peer": f"onnxruntime-genai {precision.precision}", "peer_wall_s": wall,
            "peer_peak_rss_gb": usage.ru_maxrss * 1024 / 1e9}


def memory_gb(pid: int) -> dict[str, float]:
    """VmRSS and its anonymous / file-backed parts of a live process, in GB (empty once it has gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {name: int(fields[key].split()[0]) * 1024 / 1e9 for name, key in
            (("rss", "VmRSS"), ("anon", "RssAnon"), ("file", "RssFile")) if key in fields}


def run_case(case: Case, work: Path, dtype: str, checkpoint_dtype: str, keep: bool,
             peer: bool = False) -> dict[str, Any]:
    home = work / case.name
    shutil.rmtree(home, ignore_errors=True)
    kept = work / f"{case.name}-artifact"
    try:
        started = time.perf_counter()
        if case.family == "llama":
            config, size = llama_checkpoint(home / "target", case.shape, checkpoint_dtype)
        else:
            config, size = deepseek_checkpoint(home / "target", int(case.shape))
        draft = None
        if case.eagle3:
            draft = home / "draft"
            size += eagle3_checkpoint(draft, config)
        written = time.perf_counter() - started
        result = run_export(home / "target", draft, case, home / "artifact", dtype)
        artifact = sum(f.stat().st_size for f in (home / "artifact").iterdir())
        if peer:
            result.update(run_peer(home / "target", case, home / "peer"))
        if keep:
            shutil.rmtree(kept, ignore_errors=True)
            (home / "artifact").rename(kept)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    checkpoint_gb = size / 1e9
    budget = BUDGET_PER_CHECKPOINT.get(case.shape, 0.4) * checkpoint_gb + 1.5
    return {"case": case.name, "method": case.method, "quantize": case.quantize, "dtype": dtype,
            "layers": config["num_hidden_layers"], "checkpoint_gb": checkpoint_gb, "artifact_gb": artifact / 1e9,
            **result, "rss_per_checkpoint": result["peak_rss_gb"] / checkpoint_gb, "budget_gb": budget,
            "write_s": written, "artifact": str(kept) if keep else None}


def print_table(rows: list[dict[str, Any]]) -> None:
    columns = [("case", "{}"), ("method", "{}"), ("dtype", "{}"), ("layers", "{}"), ("checkpoint_gb", "{:.2f}"),
               ("peak_rss_gb", "{:.2f}"), ("rss_per_checkpoint", "{:.2f}"), ("budget_gb", "{:.2f}"),
               ("wall_s", "{:.0f}"), ("cpu_s", "{:.0f}"), ("artifact_gb", "{:.2f}")]
    print("  ".join(f"{name:>18}" for name, _ in columns))
    for row in rows:
        print("  ".join(f"{fmt.format(row[name]):>18}" for name, fmt in columns))
    print("budget_gb = 0.25 x checkpoint + 1.5 GB for 8B shapes, 0.4 x otherwise (issue 36)")
    for row in rows:
        if "peer" in row:
            print(f"{row['case']}: {row['peer']} builder on the same checkpoint: {row['peer_wall_s']:.0f} s, "
                  f"{row['peer_peak_rss_gb']:.2f} GB peak (unispec export: {row['wall_s'] / row['peer_wall_s']:.2f}x "
                  f"its wall time)")
    for row in rows:
        print(f"{row['case']}: peak GB per stage (rss / anon / file-backed)")
        for stage, peak in row["stages"].items():
            print(f"  {stage:<26} " + " / ".join(f"{peak.get(k, 0.0):5.2f}" for k in ("rss", "anon", "file")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="1b", help="comma-separated: 1b, 3b, 8b, 1b-eagle3, ds-4l, ds-61l, 8b-eagle3:int4, ...")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "unispec-export-memory",
                        help="where checkpoints and artifacts are written (removed after each case)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="the export's --dtype")
    parser.add_argument("--checkpoint-dtype", default="bfloat16", choices=tuple(CHECKPOINT_DTYPES),
                        help="dtype of the random checkpoints")
    parser.add_argument("--keep-artifacts", action="store_true",
                        help="keep each artifact as <work>/<case>-artifact (the checkpoints still go)")
    parser.add_argument("--peer", action="store_true",
                        help="also time onnxruntime-genai's builder on each Llama checkpoint, same precision")
    args = parser.parse_args()
    cases = [parse_case(name) for name in args.cases.split(",")]
    rows = []
    for case in cases:
        rows.append(run_case(case, args.work, args.dtype, args.checkpoint_dtype, args.keep_artifacts,
                             peer=args.peer and case.family == "llama"))
        print(f"{case.name}: {rows[-1]['peak_rss_gb']:.2f} GB peak, {rows[-1]['wall_s']:.0f} s", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows)


if __name__ == "__main__":
    main()
