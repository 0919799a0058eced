"""The tiny H3 pipeline on a CUDA GPU, per varlen backend: packed == separate, and packing's gain.

    python -m benchmarks.gpu_pipeline --out $OUT/gpu_pipeline.json

Needs torch, pydantic and safetensors (no Ray). Prints a table; invents nothing without a GPU.
"""

import argparse
import json

import torch

from attention import AttentionRequirements, get_backend, probe_platform
from pipelines.h3 import GenerationRequest, load_pipeline

from .common import median, table, time_ms

BACKENDS = ("torch_varlen", "flash_attn", "torch_sdpa")
MIXED = [GenerationRequest(prompt=f"request {i}", width=64 * (1 + i % 4), height=64 * (1 + (i // 4) % 2),
                           num_frames=1 if i % 3 else 5, steps=8, seed=i) for i in range(16)]


def timed(fn, reps: int = 5) -> float:
    """Median wall ms; each call waits for the GPU, so the time covers its kernels."""

    def call():
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    return median(time_ms(call, reps))


def check_backend(name: str, device: str, dtype: str) -> dict:
    pipeline = load_pipeline("tiny", name, device=device, dtype=dtype)
    states = [pipeline.prepare(r) for r in MIXED[:3]]
    packed = pipeline.pack(states)
    together = packed.unpack(pipeline.runner(packed).cpu())
    worst, scale = 0.0, 0.0
    offset = 0
    for state in states:
        alone_pack = pipeline.pack([state])
        alone = alone_pack.unpack(pipeline.runner(alone_pack).cpu())
        for a, b in zip(alone, together[offset:offset + len(alone)]):
            worst = max(worst, (a.video - b.video).abs().max().item())
            scale = max(scale, a.video.abs().max().item())
        offset += len(alone)
    image_ms = timed(lambda: pipeline.generate(GenerationRequest(prompt="a red fox", width=256, height=256)), 3)
    fresh = [pipeline.prepare(r) for r in MIXED]
    packed_ms = timed(lambda: pipeline.step(fresh_copy(fresh)))
    separate_ms = timed(lambda: [pipeline.step([s]) for s in fresh_copy(fresh)])
    rows = pipeline.pack(fresh).total_rows
    return {"backend": name, "packed_vs_separate_max_abs": worst, "output_scale": scale,
            "image_256_8steps_ms": image_ms, "mixed16_rows": rows,
            "mixed16_packed_step_ms": packed_ms, "mixed16_separate_steps_ms": separate_ms,
            "packing_speedup": separate_ms / packed_ms}


def fresh_copy(states):
    """Sampler positions reset each repetition, so every timed step does the same work."""
    for s in states:
        s.step_index = 0
    return states


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--cpu-dry-run", action="store_true", help="exercise the script on CPU (fp32, sdpa)")
    args = parser.parse_args(argv)
    device, dtype = ("cpu", torch.float32) if args.cpu_dry_run else ("cuda", torch.bfloat16)
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return 0
    platform = probe_platform(device)
    print(f"{platform.describe()}; torch {torch.__version__}")
    results = []
    for name in BACKENDS:
        backend = get_backend(name)
        ok = backend.availability(platform, dtype=dtype, head_dim=32)
        if not ok or backend.unsupported_requirements(AttentionRequirements(packed_varlen=True)):
            print(f"{name:13s} SKIP: {ok.reason}")
            continue
        results.append(check_backend(name, device, str(dtype).removeprefix("torch.")))
    if results:
        table(list(results[0]), [list(r.values()) for r in results])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"platform": json.loads(platform.model_dump_json()), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
