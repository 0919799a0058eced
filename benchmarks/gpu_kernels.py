"""GPU kernel benchmark: packed varlen attention and one full-size H3 block, forward only.

    python -m benchmarks.gpu_kernels --out $OUT/gpu_kernels.json   # one H200, under 5 minutes
    python -m benchmarks.gpu_kernels --quick --out /tmp/gk.json    # small sizes, seconds
    python -m benchmarks.gpu_kernels --cpu-dry-run --out /tmp/gk.json  # same code paths, tiny, CPU

Part 1 is ``h3serve.attention.measure`` (what ``h3serve rank-attention`` runs): it checks and times each
backend's own ``forward_varlen`` on packs of mixed-size documents and on one long document, and ranks the
backends that passed (fastest first) into a ranking file for this platform (``--ranking-out``; see
h3serve/attention/ranking.py for how ``auto`` uses it). Part 2 times one diffusers ``MiniMaxH3TransformerBlock``
at the released dimensions (hidden 5376, 56 heads x 128, SwiGLU 14336) through h3serve's attention processor, over
packs of T2VA requests laid out by diffusers' layout builders. Needs torch, diffusers and pydantic plus this
repo's ``attention`` and ``pipelines`` packages (no Ray).
"""

from __future__ import annotations

import argparse
import os

import torch
from diffusers.models.transformers.transformer_minimax_h3 import (
    MINIMAX_H3_MODALITY_NUM,
    MiniMaxH3RotaryPosEmbed,
    MiniMaxH3TransformerBlock,
)

from h3serve.attention import get_backend, probe_platform
from h3serve.attention.measure import (
    BACKENDS,
    dtype_name,
    environment,
    matmul_tflops,
    measured_ranking,
    part1_varlen,
    sdpa_fused_backends,
    tflops,
)
from h3serve.attention.measure import SIZES as MEASURE_SIZES
from h3serve.attention.ranking import save as save_ranking
from h3serve.pipelines.h3.attention_processor import Documents, H3VarlenAttnProcessor, attending
from h3serve.pipelines.h3.packing import pack_documents
from h3serve.pipelines.h3.shapes import Clip, block_flops, clip_document, transformer_config

from .harness import PEAK_TFLOPS, Budget, attempt, cli, median_ms, say, table, write_json

NOTES = [
    "Attention FLOPs = sum over real documents of 4 * len^2 * H * D; the trailing padding "
    "segment is computed by the kernels but not counted.",
    f"% peak is against {PEAK_TFLOPS:.0f} TFLOP/s (H200 bf16 dense spec); bf16 matmul was measured "
    "earlier at ~790 TFLOP/s on this machine, and this run measures its own (% matmul column).",
    "Anchors: FlashAttention-2 forward reaches ~35% of H100 bf16 peak, FlashAttention-3 ~75%.",
]
# Part 2's packs: T2VA requests as "WIDTHxHEIGHTxFRAMES"; 1344x768x124 is the released default (~38k rows).
BLOCK = {  # block_packs: the requests packed for Part 2 (Part 1's sizes: h3serve.attention.measure.SIZES)
    "full": dict(
        preset="full",
        text_tokens=256,
        block_packs=[["896x512x124"], ["1344x768x124"], ["896x512x124", "896x512x141"]],
    ),
    "quick": dict(preset="full", text_tokens=256, block_packs=[["512x288x124"]]),
    "cpu": dict(preset="tiny", text_tokens=32, block_packs=[["128x64x124"], ["64x64x124", "96x64x141"]]),
}
SIZES = {mode: {**MEASURE_SIZES[mode], **block} for mode, block in BLOCK.items()}


# -- Part 2: one H3 block --------------------------------------------------------------------------


def block_inputs(cfg: dict, clips: list[Clip], device: str, dtype: torch.dtype) -> dict:
    """A pack of T2VA documents and what ``MiniMaxH3TransformerBlock.forward`` takes for it, as packed_forward
    builds them; the residual stream and the timestep embedding come from embeddings there, random costs the same."""
    pack = pack_documents([clip_document(cfg, c, seed=j) for j, c in enumerate(clips)]).to(device)
    rope = MiniMaxH3RotaryPosEmbed(cfg["rope_freq_dim"], cfg["rope_theta"]).to(device)
    T, K = pack.total_rows, pack.timestep.numel()
    return dict(
        pack=pack,
        hidden=torch.randn(1, T, cfg["hidden_size"], device=device, dtype=dtype),  # [1, T, d]
        temb=torch.randn(K, cfg["time_embed_dim"], device=device),  # [K, e] fp32, as time_embedder's
        adaln_indices=pack.timestep_indices * MINIMAX_H3_MODALITY_NUM + pack.token_tags,  # [T]
        rotary_emb=rope(pack.position_ids),
    )  # cos, sin: [T, 6 * rope_freq_dim]


def part2_block(s, device, dtype, status, budget, res) -> None:
    cfg = transformer_config(s["preset"])
    names = [n for n in BACKENDS if status.get(n) == "PASS"]
    H, D = cfg["num_attention_heads"], cfg["attention_head_dim"]
    say(
        f"\n== Part 2: one MiniMaxH3TransformerBlock (diffusers) through h3serve's processor, preset {s['preset']} "
        f"(hidden {cfg['hidden_size']}, {H} heads x {D}, ffn {cfg['ffn_dim']}), every backend that passed"
    )
    if not names:
        say("  no backend passed the correctness check; skipped")
        budget.skipped.append("block: no passing backend")
        return
    with torch.device(device):  # initialise on the GPU: a 645M-parameter CPU init is slow
        block = MiniMaxH3TransformerBlock(
            hidden_size=cfg["hidden_size"],
            num_attention_heads=H,
            attention_head_dim=D,
            ffn_dim=cfg["ffn_dim"],
            time_embed_dim=cfg["time_embed_dim"],
            norm_eps=cfg["norm_eps"],
            qk_norm_eps=cfg["qk_norm_eps"],
        )
    block = block.to(dtype).eval()
    rows = []
    for names_of_clips in s["block_packs"]:
        clips = [Clip(*map(int, c.split("x")), text_tokens=s["text_tokens"]) for c in names_of_clips]
        if budget.over(f"block {'+'.join(names_of_clips)}"):
            continue
        inp = block_inputs(cfg, clips, device, dtype)
        pack = inp["pack"]
        T, docs = pack.total_rows, Documents(pack.cu_seqlens, pack.max_seqlen)
        q, k, v = (torch.randn(T, H, D, device=device, dtype=dtype) for _ in range(3))  # [T, H, D]
        flops = block_flops(cfg, pack)
        for name in names:
            impl = get_backend(name).make_impl()
            block.attn.set_processor(H3VarlenAttnProcessor(impl))  # same weights, only the kernel changes

            def block_fn(docs=docs, inp=inp):
                with attending(docs):
                    return block(inp["hidden"], inp["temb"], inp["adaln_indices"], inp["rotary_emb"])

            def attn_fn(impl=impl, q=q, k=k, v=v, pack=pack):
                return impl.forward_varlen(q, k, v, cu_seqlens=pack.cu_seqlens, max_seqlen=pack.max_seqlen)

            block_ms, error = attempt(lambda fn=block_fn: median_ms(fn, device, s["warmup"], s["reps"]))
            attn_ms, attn_error = attempt(lambda fn=attn_fn: median_ms(fn, device, s["warmup"], s["reps"]))
            both = block_ms is not None and attn_ms is not None
            tf = None if block_ms is None else tflops(flops["total"], block_ms)
            r = {
                "backend": name,
                "requests": names_of_clips,
                "rows": T,
                "padding_rows": pack.padding_rows,
                "doc_lengths": pack.lengths,
                "matmul_flops": flops["matmul"],
                "attention_flops": flops["attention"],
                "block_ms": block_ms,
                "tflops": tf,
                "mfu_pct": tf and 100 * tf / PEAK_TFLOPS,
                "attention_kernel_ms": attn_ms,
                "rest_ms": block_ms - attn_ms if both else None,
                "attention_pct": 100 * attn_ms / block_ms if both else None,
                "error": error or attn_error,
            }
            res["block"].append(r)
            rows.append(
                [" + ".join(names_of_clips), T, max(pack.lengths), name]
                + [
                    r[c]
                    for c in (
                        "block_ms",
                        "tflops",
                        "mfu_pct",
                        "attention_kernel_ms",
                        "rest_ms",
                        "attention_pct",
                        "error",
                    )
                ]
            )
        del inp, q, k, v
    table(
        ["requests", "T", "max_len", "backend", "block ms", "TFLOP/s", "MFU %", "attn ms", "rest ms", "attn %", "note"],
        rows,
    )
    say(
        "  FLOPs (h3serve/pipelines/h3/shapes.py): q/k/v/out and SwiGLU matmuls over all T rows, the AdaLN table per\n"
        "  distinct timestep, attention 4 L^2 H D per document."
    )
    say("  attn ms = the kernel call alone on the same pack; rest = block - attn (projections, norms, RoPE, FFN).")


def options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", dest="json", help="write every number and the environment to this JSON file (= --json)")
    ap.add_argument("--quick", action="store_true", help="much smaller sizes, to dry-run in seconds")
    ap.add_argument("--max-seconds", type=float, default=270.0, help="skip remaining cases past this")
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on CPU, float32")
    ap.add_argument(
        "--ranking-out",
        metavar="PATH",
        help="write the measured backend ranking here (default: attention_ranking.json beside --out); "
        "point H3SERVE_ATTENTION_RANKING at it for auto selection",
    )


def run(args: argparse.Namespace) -> dict:
    if args.ranking_out is None and args.json:
        args.ranking_out = os.path.join(os.path.dirname(os.path.abspath(args.json)), "attention_ranking.json")
    res: dict = {}

    def save() -> None:  # every number so far, before the next case: a step cut at its timeout loses one case
        write_json(args.json, {**res, "wall_s": budget.elapsed()}, quiet=True)

    budget = Budget(args.max_seconds, checkpoint=save)
    if args.cpu_dry_run:
        device, dtype, mode = "cpu", torch.float32, "cpu"
    elif torch.cuda.is_available():
        device, dtype, mode = "cuda", torch.bfloat16, "quick" if args.quick else "full"
    else:
        device, dtype, mode = None, None, None
    platform = probe_platform(device or "cuda")
    res |= {
        "env": environment(platform),
        "mode": mode,
        "settings": SIZES.get(mode),
        "peak_tflops": PEAK_TFLOPS,
        "notes": NOTES,
        "availability": {},
        "correctness": [],
        "varlen": [],
        "block": [],
        "ranking": None,
        "skipped": budget.skipped,
    }
    say(f"platform: {platform.describe()}; torch {torch.__version__}, CUDA {torch.version.cuda}")
    if device is None:
        say("No CUDA device: nothing measured. (Use --cpu-dry-run to exercise the script on CPU.)")
        res["skipped"].append("everything: no CUDA device")
    else:
        s = SIZES[mode]
        torch.set_float32_matmul_precision("highest")  # the fp32 reference must not use TF32
        try:
            with torch.inference_mode():
                res["matmul_tflops"] = matmul_tflops(device, dtype, s["matmul_n"], s["warmup"], s["reps"])
                save()
                res["sdpa_loop_fused_kernels"] = sdpa_fused_backends(device, dtype, s["head_dim"])
                say(f"measured {dtype_name(dtype)} matmul {s['matmul_n']}^3: {res['matmul_tflops']:.4g} TFLOP/s")
                say(
                    "fused SDPA kernels that take the torch_sdpa loop's [1, H, L, D] slices: "
                    + (", ".join(res["sdpa_loop_fused_kernels"]) or "none (math backend: L x L scores in memory)")
                )
                for note in NOTES + (["CPU dry run: % of H200 peak is meaningless here."] if device == "cpu" else []):
                    say(f"note: {note}")
                status, res["error"] = attempt(
                    lambda: part1_varlen(s, device, dtype, platform, budget, res, peak_tflops=PEAK_TFLOPS, table=table)
                )
                ranking = measured_ranking(res, status or {}, platform, dtype, s, mode, "benchmarks.gpu_kernels")
                res["ranking"] = ranking and ranking.model_dump(mode="json")
                say("\nranking: " + (ranking.describe() if ranking else "none (no backend passed every pack)"))
                if ranking and args.ranking_out:
                    say(f"wrote {save_ranking(ranking, args.ranking_out)}")
                save()
                _, block_error = attempt(lambda: part2_block(s, device, dtype, status or {}, budget, res))
                res["error"] = res["error"] or block_error
                if res["error"]:
                    say(f"ERROR: {res['error']}")
        except Exception as e:  # report, write what we have, exit 0
            res["error"] = f"{type(e).__name__}: {e}"
            say(f"ERROR: {res['error']}")
    res["wall_s"] = budget.elapsed()
    if budget.skipped:
        say(f"\nskipped ({len(budget.skipped)}): {', '.join(budget.skipped)}")
    say(f"\nwall {res['wall_s']:.1f} s")
    return res  # written to --out by the harness; the exit status is 0 whatever was measured


main = cli(__doc__, run, options, __name__)
