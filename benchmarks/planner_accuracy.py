"""Expected peak (the planner) against measured peak, on the tiny random models, a mid-size
random MoE and the embedded SmolLM2-135M.

Each case runs in a fresh process: load the tokenizer (its RSS is the runtime base the worker
would report), load the weights, prefill a prompt of T tokens in 512-token steps and decode
N tokens with mlx-lm's `generate_step` (the engine's path), fp16/fp32 KV, no paging.

Two peaks are compared, because "peak" means two things on a CPU:
- MLX peak (`mx.get_peak_memory()`): the arrays MLX allocated at its highest point: weights +
  KV + transient activations. Compared with the plan's dense + experts + KV + recurrent +
  activations.
- Process peak (VmHWM, the kernel's high-water mark of this process's resident memory; not
  `ru_maxrss`, which Linux carries over from the parent across exec): the above plus
  the Python/MLX/tokenizer runtime and MLX's buffer cache. Compared with the plan's process
  peak (the above + the measured runtime base).
On Apple silicon, the Metal buffers are wired GPU memory and `mx.get_peak_memory` counts them
the same way; RSS there also counts the Metal framework. This run is Linux CPU only.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        .venv/bin/python benchmarks/planner_accuracy.py
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "results" / "planner_accuracy.json"
TARGET = 0.10  # |expected - measured| / measured
SHARE_CONTEXTS = (2048, 8192)

# A mid-size random MoE: weights and KV large enough that the runtime does not dominate.
MID_MOE = {
    "model_type": "qwen3_moe",
    "hidden_size": 768,
    "num_hidden_layers": 6,
    "intermediate_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_intermediate_size": 384,
    "rms_norm_eps": 1e-6,
    "vocab_size": 1000,
    "rope_theta": 1e6,
    "tie_word_embeddings": False,
    "max_position_embeddings": 32768,
    "norm_topk_prob": True,
}


def _vm_hwm() -> int:
    """Peak resident set of this process (Linux /proc), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


MID_NEMOTRON = {
    "model_type": "nemotron_h",
    "vocab_size": 1000,
    "hidden_size": 768,
    "intermediate_size": 1024,
    "max_position_embeddings": 32768,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "attention_bias": False,
    "mamba_num_heads": 32,
    "mamba_head_dim": 32,
    "mamba_proj_bias": False,
    "ssm_state_size": 64,
    "conv_kernel": 4,
    "n_groups": 4,
    "mlp_bias": False,
    "layer_norm_epsilon": 1e-5,
    "use_bias": False,
    "use_conv_bias": True,
    "hybrid_override_pattern": "M*EMEM*E",
    "moe_intermediate_size": 384,
    "moe_shared_expert_intermediate_size": 768,
    "n_group": 1,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "topk_group": 1,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "mlp_hidden_act": "relu2",
    "time_step_limit": [0.0, 1e9],
    "tie_word_embeddings": False,
}


def child(folder: str, prompt_tokens: int, gen_tokens: int) -> dict:
    """Runs in the measuring process; prints one JSON line."""
    import psutil

    proc = psutil.Process()
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model, load_tokenizer

    load_tokenizer(Path(folder))
    base = proc.memory_info().rss  # Python + MLX + mlx-lm + tokenizer, no weights yet
    model, _ = load_model(Path(folder))
    mx.eval(model.parameters())
    load_hwm = _vm_hwm()  # loading can have its own peak (file buffers, sanitize copies)
    load_mlx_peak = mx.get_peak_memory()
    mx.reset_peak_memory()
    cache = make_prompt_cache(model)
    prompt = mx.array([(i * 7919) % 900 + 17 for i in range(prompt_tokens)])
    t0 = time.perf_counter()
    steps = generate_step(
        prompt, model, max_tokens=gen_tokens, prompt_cache=cache, prefill_step_size=512
    )
    n = sum(1 for _ in steps)
    seconds = time.perf_counter() - t0
    kv = sum(c.nbytes for c in cache)
    return {
        "runtime_base": base,
        "mlx_peak": mx.get_peak_memory(),
        "rss_peak": _vm_hwm(),
        "rss_end": proc.memory_info().rss,
        "rss_peak_after_load": load_hwm,
        "mlx_peak_load": load_mlx_peak,
        "mlx_active_end": mx.get_active_memory(),
        "mlx_cache_end": mx.get_cache_memory(),
        "kv_nbytes": kv,
        "generated": n,
        "seconds": round(seconds, 2),
    }


def share_child(folder: str) -> dict:
    """Measured KV-attention share (profile.py) against the bytes estimate, fp16/fp32 KV."""
    from app.engine import loader, profile
    from app.engine.sizes import sizes_for

    lm = loader.load(folder)
    prof = profile.measure_share(
        lm.model, {"model": folder}, contexts=SHARE_CONTEXTS, use_cache=False
    )
    s = sizes_for(folder)
    return {
        "step_seconds": {"1": prof.base, **prof.times},
        "measured": {str(t): round(prof.share(t).share, 4) for t in SHARE_CONTEXTS},
        "estimated": {str(t): round(profile.estimate_share(s, t).share, 4) for t in SHARE_CONTEXTS},
    }


def expected(folder: Path, context: int, runtime_base: int) -> dict:
    import psutil

    from app.engine.planner import Machine, make_plan
    from app.engine.sizes import sizes_for

    s = sizes_for(folder)
    m = Machine(psutil.virtual_memory().total, "cpu", runtime_base=runtime_base)
    p = make_plan(s, m, context, kv_mode="fp16")
    mlx_part = p.process_peak - p.peak["runtime"]
    return {
        "plan_peak": p.peak,
        "mlx": mlx_part,
        "process": p.process_peak,
        "kv": p.peak["kv_cache"],
    }


def run_case(name: str, folder: Path, prompt_tokens: int, gen_tokens: int) -> dict:
    env = dict(os.environ)
    r = subprocess.run(
        [sys.executable, __file__, "--child", str(folder), str(prompt_tokens), str(gen_tokens)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    meas = json.loads(r.stdout.strip().splitlines()[-1])
    exp = expected(folder, prompt_tokens + gen_tokens, meas["runtime_base"])
    err_mlx = (exp["mlx"] - meas["mlx_peak"]) / meas["mlx_peak"]
    err_proc = (exp["process"] - meas["rss_peak"]) / meas["rss_peak"]
    return {
        "model": name,
        "prompt_tokens": prompt_tokens,
        "gen_tokens": gen_tokens,
        "measured": meas,
        "expected": exp,
        "error_mlx_peak": round(err_mlx, 4),
        "error_process_peak": round(err_proc, 4),
        "kv_expected_vs_nbytes": [exp["kv"], meas["kv_nbytes"]],
        "within_target": abs(err_mlx) < TARGET and abs(err_proc) < TARGET,
    }


def main() -> None:
    from app.engine.embedded import ensure_default_model
    from app.engine.testing.random_models import TINY_ARCHS, make_random_model

    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("ROTARYQUANT_HOME", str(Path(tmp) / "home"))
        for arch in TINY_ARCHS + ("llama",):
            cases.append(
                (f"tiny-{arch}", make_random_model(arch, Path(tmp) / arch, seed=0), 2048, 32)
            )
        # float32: MLX's CPU gather_mm (unquantized experts) runs only in float32
        mid = make_random_model(MID_MOE, Path(tmp) / "mid", seed=0, dtype="float32")
        cases.append(("mid-qwen3_moe (fp32)", mid, 4096, 32))
        nem = make_random_model(MID_NEMOTRON, Path(tmp) / "midnem", seed=0, dtype="float32")
        cases.append(("mid-nemotron_h (fp32)", nem, 4096, 32))
        smol = ensure_default_model()
        # quantized matmul is slow on this CPU (~1 min per 512 prompt tokens): keep it short
        cases.append(("SmolLM2-135M (4-bit)", smol, 1024, 8))
        only = os.environ.get("ACCURACY_ONLY")  # a substring of case names, for quick reruns
        rows = [run_case(*c) for c in cases if not only or only in c[0]]
        shares = {}
        for name, folder, *_ in cases:
            if (only and only not in name) or not name.startswith(("mid", "Smol")):
                continue
            r = subprocess.run(
                [sys.executable, __file__, "--share", str(folder)],
                capture_output=True,
                text=True,
                check=True,
            )
            shares[name] = json.loads(r.stdout.strip().splitlines()[-1])
    print(
        f"{'model':24s} {'T':>5s} {'MLX exp':>9s} {'MLX meas':>9s} {'err':>7s} {'RSS exp':>9s} {'RSS meas':>9s} {'err':>7s}"
    )
    for r in rows:
        e, m = r["expected"], r["measured"]
        print(
            f"{r['model']:24s} {r['prompt_tokens']:5d} {e['mlx'] / 2**20:8.1f}M {m['mlx_peak'] / 2**20:8.1f}M "
            f"{r['error_mlx_peak']:+7.1%} {e['process'] / 2**20:8.1f}M {m['rss_peak'] / 2**20:8.1f}M {r['error_process_peak']:+7.1%}"
        )
    print(f"\n{'model':24s} {'T':>5s} {'share measured':>15s} {'estimated':>10s}")
    for name, d in shares.items():
        for t in SHARE_CONTEXTS:
            print(f"{name:24s} {t:5d} {d['measured'][str(t)]:15.1%} {d['estimated'][str(t)]:10.1%}")
    import mlx.core as mx

    result = {
        "what": "planner expected peak vs measured peak (mx.get_peak_memory and VmHWM), fp16 KV, no paging",
        "command": "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 .venv/bin/python benchmarks/planner_accuracy.py",
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "mlx": mx.__version__,
            "backend": "cpu",
        },
        "target": TARGET,
        "all_within_target": all(r["within_target"] for r in rows),
        "cases": rows,
        "attention_share": {
            "what": "share of decode time in KV attention: measured (decode step with T cached tokens vs 1, profile.py) vs estimated from bytes read per token; this CPU, no fused kernels",
            "models": shares,
        },
    }
    from record import write_result  # benchmarks/ is the script's folder, first on sys.path

    write_result("planner_accuracy", result, result.pop("machine"), OUT)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--share":
        print(json.dumps(share_child(sys.argv[2])))
    elif len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
    else:
        main()
