"""One released clip's video decode on one GPU: serial against split by whole tiles, bf16 as released (issue 56).

    python -m benchmarks.gpu_decode --json $OUT/gpu_decode.json          # one H200: ~20-30 s (projected)
    python -m benchmarks.gpu_decode --cpu-dry-run --json /tmp/gd.json    # same code paths, tiny VAE, CPU

diffusers' ``AutoencoderKLMiniMaxH3`` at its defaults (the released config: its 36-layer ViT decoder, released
temporal chunks and 256-pixel spatial tiles), random weights made on the device, then typed as
``from_pretrained(torch_dtype=torch.bfloat16)`` types them (diffusers' ``_keep_in_fp32_modules`` in fp32; TF32
where fp32 remains, as a decoder stage runs it), decodes one clip's latents ``[1, 24, 37, 48, 84]`` (1344x768, 124
frames; 196 tiles):

  1. ``serial``: ``vae.decode`` as one decoder replica runs it (wall time, peak memory beyond the weights, and
     TFLOP/s against the 1,893 TFLOP counted on the meta device: docs/BENCHMARKS.md section 19);
  2. ``split``: the same latents through ``h3serve.pipelines.h3.tiled_decode`` (record the tiles, decode each,
     blend with diffusers' own code), each tile timed on its own, the frames compared with the serial decode's
     (bit for bit, as on CPU). One GPU cannot time a split over several: the seconds over 2, 4 and 8 decoders are
     **projected** from the measured tiles (recording + blend + the longest of ``tiled_decode.split``'s runs; the
     transfer of the decoded tiles between replicas left out), and the peak per tile is what each decoder needs
     beyond its weights and the tiles it returns;
  3. ``audio``: ``AutoencoderKLMiniMaxH3Audio`` at its defaults (fp32: diffusers keeps all of it, with TF32) on
     both stereo channels of the same clip (``[2, 32, 207]``): what runs beside the video decode.

A warm-up decodes one tile first (cuDNN/cuBLAS first-call costs). Every part saves the JSON as it finishes; one
cut at the session's cap loses only the part it was in. Needs torch and diffusers (no Ray, no checkpoint).
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Any

import torch

from h3serve.pipelines.h3 import tiled_decode
from h3serve.pipelines.h3.shapes import human_bytes, keeps_fp32

from .harness import Budget, attempt, cli, no_cuda, say, table, write_json

PARTS = ["serial", "split", "audio"]
RELEASED_DECODE_FLOPS = 1_893e12  # one released clip's video decode, counted on meta (BENCHMARKS.md section 19)
AUDIO_LATENTS_PER_S, FPS = 40, 24
SPLITS = (2, 4, 8)  # decoders the split is projected over
SETTINGS = {
    # latents [1, C, 5n+2, H/16, W/16] of a 124-frame clip (17n+5 frames, n=7)
    "full": dict(device="cuda", canvas=(1344, 768), frames=124, tiny=False),
    # 2 chunks of 2 tiles: the temporal and the spatial blends run
    "cpu": dict(device="cpu", canvas=(320, 128), frames=39, tiny=True),
}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_since(device: str, base: int) -> int | None:
    """The allocator's peak since the last reset, beyond ``base`` bytes (None on CPU: no counters)."""
    return torch.cuda.max_memory_allocated() - base if device == "cuda" else None


def reset_peak(device: str) -> int:
    """Resets the peak counter; the bytes allocated now (0 on CPU)."""
    if device != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


@torch.no_grad()
def build(cls, config: dict, device: str, dtype: torch.dtype) -> Any:
    """``cls(**config)`` with random weights made on ``device`` (its own init, buffers included), typed as diffusers'
    loader types a checkpoint at ``dtype``: ``_keep_in_fp32_modules`` stays fp32 (the rule h3serve's loads use)."""
    torch.manual_seed(0)
    with warnings.catch_warnings(), torch.device(device):
        warnings.simplefilter("ignore")  # the audio VAE's weight_norm deprecation
        model = cls(**config)
    for name, param in model.named_parameters():
        if not keeps_fp32(model, name):
            param.data = param.data.to(dtype)
    return model.eval().requires_grad_(False)


def runs_of(values: list[float], sizes: list[int]) -> list[list[float]]:
    """``values`` cut into consecutive runs of ``sizes``: each decoder's tiles, in the served split's order."""
    out, start = [], 0
    for size in sizes:
        out.append(values[start : start + size])
        start += size
    return out


class Bench:
    def __init__(self, s: dict, json_path: str | None, budget: Budget):
        from diffusers import AutoencoderKLMiniMaxH3

        self.s, self.device, self.json_path, self.budget = s, s["device"], json_path, budget
        self.dtype = torch.bfloat16
        if self.device == "cuda":  # a decoder stage holds no transformer: its fp32 modules use TF32
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        else:  # a dry run checks the steps: one thread does not spin against a loaded CI machine's other work
            torch.set_num_threads(1)
        config = self.tiny_config("vae") if s["tiny"] else {}
        start = time.perf_counter()
        self.vae = build(AutoencoderKLMiniMaxH3, config, self.device, self.dtype)
        sync(self.device)
        width, height = s["canvas"]
        frames = (s["frames"] - 5) // 17 * 5 + 2  # 17n+5 frames -> 5n+2 latent frames
        shape = (1, self.vae.config.latent_channels, frames, height // 16, width // 16)
        # the denoiser's latents arrive in its dtype; the decode casts them to post_quant_conv's, as diffusers does
        self.latents = tiled_decode.latents_for_decoder(
            self.vae, torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(self.device, self.dtype)
        )
        weights = sum(p.numel() * p.element_size() for p in self.vae.parameters())
        self.res: dict = {
            "vae": "tiny preset" if s["tiny"] else "released (diffusers' defaults)",
            "device": self.device,
            "dtype": "bfloat16 (_keep_in_fp32_modules fp32" + (", TF32)" if self.device == "cuda" else ")"),
            "clip": f"{width}x{height}x{s['frames']}",
            "latents": list(shape),
            "weights_bytes": weights,
            "build_s": time.perf_counter() - start,
            "serial": {},
            "split": {},
            "audio": {},
            "skipped": budget.skipped,
            "errors": {},
        }
        self.frames: torch.Tensor | None = None  # the serial decode's, for the split's comparison
        say(f"built the video VAE ({self.res['vae']}, {human_bytes(weights)}) in {self.res['build_s']:.1f} s")

    @staticmethod
    def tiny_config(name: str) -> dict:
        from h3serve.pipelines.h3.config import preset

        return dict(preset("tiny").components[name])

    def save(self) -> None:
        write_json(self.json_path, self.res, quiet=True)

    def warm_up(self) -> None:
        """One tile through the decoder: the kernels' first-call costs, paid before anything is timed."""
        start = time.perf_counter()
        tiled_decode.decode_tiles(self.vae, tiled_decode.tiles_of(self.vae, self.latents)[:1])
        sync(self.device)
        self.res["warm_up_s"] = time.perf_counter() - start

    # -- 1. the serial decode ---------------------------------------------------------------------------------
    def serial(self) -> None:
        base = reset_peak(self.device)
        start = time.perf_counter()
        frames = self.vae.decode(self.latents, return_dict=False)[0]  # [1, 3, F, H, W]
        sync(self.device)
        seconds = time.perf_counter() - start
        self.frames = frames
        r = self.res["serial"] = {
            "s": seconds,
            "frames_shape": list(frames.shape),
            "peak_bytes": peak_since(self.device, base),
        }
        if not self.s["tiny"]:
            r["tflops"] = RELEASED_DECODE_FLOPS / seconds / 1e12
        say(
            f"\n== 1. serial decode of latents {self.res['latents']}: {seconds:.2f} s"
            + (f", {r['tflops']:.0f} TFLOP/s" if "tflops" in r else "")
            + (f", peak {human_bytes(r['peak_bytes'])} beyond what was allocated" if r["peak_bytes"] else "")
        )

    # -- 2. split by whole tiles -------------------------------------------------------------------------------
    def split(self) -> None:
        vae, device = self.vae, self.device
        base = reset_peak(device)
        peak = 0  # the whole split path's peak beyond ``base``, on this one device

        def note_peak() -> None:
            nonlocal peak
            if device == "cuda":
                peak = max(peak, torch.cuda.max_memory_allocated() - base)

        start = time.perf_counter()
        tiles = tiled_decode.tiles_of(vae, self.latents)  # recorded: shapes only, nothing decoded
        record_s = time.perf_counter() - start
        decoded, tile_s, tile_peak = [], [], 0
        for tile in tiles:  # each tile alone, as a decoder replica decodes its run of them
            before = reset_peak(device)
            t0 = time.perf_counter()
            decoded.extend(tiled_decode.decode_tiles(vae, [tile]))
            sync(device)
            tile_s.append(time.perf_counter() - t0)
            tile_peak = max(tile_peak, peak_since(device, before) or 0)
            note_peak()
        t0 = time.perf_counter()
        frames = tiled_decode.blend(vae, self.latents, decoded)
        sync(device)
        blend_s = time.perf_counter() - t0
        note_peak()
        total = time.perf_counter() - start
        r: dict = {
            "tiles": len(tiles),
            "s": total,
            "record_s": record_s,
            "tiles_s": sum(tile_s),
            "blend_s": blend_s,
            "tile_s": tile_s,
            "tile_output_bytes": decoded[0].numel() * decoded[0].element_size(),
            "peak_bytes": peak if device == "cuda" else None,  # beyond what was allocated before
            "tile_peak_bytes": tile_peak if device == "cuda" else None,
        }
        if self.frames is not None:
            same = (frames == self.frames) | (frames.isnan() & self.frames.isnan())
            r["equal"] = bool(same.all())
            r["max_abs_diff"] = float((frames.float() - self.frames.float()).abs().nan_to_num().max())
        # PROJECTED: each decoder decodes its consecutive run of tiles as fast as this GPU did; the owner records and
        # blends; the decoded tiles' transfer between replicas is not counted
        runs = {n: runs_of(tile_s, [len(run) for run in tiled_decode.split(tiles, n)]) for n in SPLITS}
        r["projected_split_s"] = {n: record_s + blend_s + max(sum(run) for run in runs[n]) for n in SPLITS}
        self.res["split"] = r
        say(
            f"\n== 2. split by whole tiles: {len(tiles)} tiles, {total:.2f} s on this one device (record "
            f"{record_s:.2f} + tiles {sum(tile_s):.2f} + blend {blend_s:.2f}); frames equal to the serial decode's: "
            + ("YES" if r.get("equal") else "NO" if "equal" in r else "not compared (no serial decode)")
        )
        rows = [[n, r["projected_split_s"][n], max(len(run) for run in runs[n])] for n in SPLITS]
        table(["decoders", "PROJECTED s", "tiles on the busiest"], rows, "the split over several decoders, projected")

    # -- 3. the audio decode beside it -------------------------------------------------------------------------
    def audio(self) -> None:
        from diffusers import AutoencoderKLMiniMaxH3Audio

        config = self.tiny_config("audio_vae") if self.s["tiny"] else {}
        audio_vae = build(AutoencoderKLMiniMaxH3Audio, config, self.device, self.dtype)
        n = round(self.s["frames"] / FPS * AUDIO_LATENTS_PER_S)
        z = torch.randn(2, audio_vae.config.latent_channels, n, device=self.device)  # the stereo channels as a batch
        audio_vae.decode(z, return_dict=False)  # first-call costs
        sync(self.device)
        base = reset_peak(self.device)
        start = time.perf_counter()
        audio_vae.decode(z, return_dict=False)
        sync(self.device)
        self.res["audio"] = {"latents": list(z.shape), "s": time.perf_counter() - start}
        self.res["audio"]["peak_bytes"] = peak_since(self.device, base)
        say(f"\n== 3. audio decode of latents {list(z.shape)} (fp32): {self.res['audio']['s']:.3f} s")


def run(args: argparse.Namespace) -> dict:
    mode = "cpu" if args.cpu_dry_run else "full"
    s = SETTINGS[mode]
    if (refused := no_cuda(mode, s["device"])) is not None:
        return refused
    budget = Budget(args.max_seconds)
    res: dict = {"mode": mode, "skipped": budget.skipped}
    with torch.inference_mode():
        bench, res["error"] = attempt(lambda: Bench(s, args.json, budget))
        if bench is not None:
            budget.checkpoint = bench.save
            res = bench.res
            res["mode"] = mode
            _, error = attempt(bench.warm_up)
            if error:
                res["errors"]["warm_up"] = error
            for name in args.parts:
                if budget.over(name):
                    continue
                _, error = attempt(getattr(bench, name))
                if error:
                    res["errors"][name] = error
                    say(f"ERROR in {name}: {error}")
                bench.save()
    write_json(args.json, res, quiet=True)
    say(f"wall {budget.elapsed():.1f} s")
    return res  # the exit status is 0 whatever was measured


def options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS, help="in order (default: all)")
    ap.add_argument("--max-seconds", type=float, default=60.0, help="skip the remaining parts past this")
    ap.add_argument("--cpu-dry-run", action="store_true", help="the same code paths with the tiny VAEs on CPU")


main = cli(__doc__, run, options, __name__)
