"""The packed multi-request forward: diffusers' MiniMax-H3 submodules over one pack of documents.

``MiniMaxH3Transformer3DModel.forward`` runs one layout as one attention document. This runs the
same submodules in the same order and precision over a pack of many documents (one per request,
each at its own step), with attention bounded per document by ``cu_seqlens``, and optionally with
the rows sharded over Ulysses ranks. For a pack of one document it computes what ``forward`` does.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from diffusers.models.modeling_utils import get_parameter_dtype
from diffusers.models.transformers.transformer_minimax_h3 import MINIMAX_H3_MODALITY_NUM

from .attention_processor import Documents, SequenceParallel, attending
from .lora import LoraAdapter, adapting, pack_slots
from .packing import Pack
from .step_cache import PackCache, ShardedRows, cached_blocks


def _local(
    indices: torch.Tensor, rows: torch.Tensor, lo: int, hi: int, total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows whose pack positions fall in [lo, hi), with positions made local."""
    if lo == 0 and hi == total:  # one rank holds every row: no mask, whose nonzero would make the host wait
        return indices, rows
    keep = (indices >= lo) & (indices < hi)
    return indices[keep] - lo, rows[keep]


@torch.no_grad()
def packed_forward(
    model,
    pack: Pack,
    sp: SequenceParallel | None = None,
    cache: PackCache | None = None,
    adapters: Mapping[int, LoraAdapter] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Velocities of every video and audio row of ``pack``, in the order of its video/audio indices.

    With ``sp``, this rank computes rows ``[rank*T/W, (rank+1)*T/W)`` and rank 0 returns the result
    (other ranks return None). ``pack`` must already be on the model's device. With ``cache`` (one
    entry per document), each document with a policy may skip the middle blocks (``step_cache``);
    its state is updated only when the whole forward succeeded. Without one, nothing changes.
    Under ``sp`` every rank gets its own ``cache`` (the same states: ``step_cache.RankCaches``).
    ``adapters`` (slot -> adapter placed on ``model``) serve the documents whose ``pack.document_slots``
    are not 0 (``lora.adapting``, this rank's rows); a pack of base documents only runs exactly as without.
    """
    if not pack.adapted:
        return _packed_forward(model, pack, sp, cache)
    rank, world = (sp.rank, sp.sp_degree) if sp is not None else (0, 1)
    with adapting(model, adapters or {}, pack_slots(pack, pack.document_slots, rank, world), pack.compositions or None):
        return _packed_forward(model, pack, sp, cache)


def _packed_forward(
    model, pack: Pack, sp: SequenceParallel | None, cache: PackCache | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    rank, world = (sp.rank, sp.sp_degree) if sp is not None else (0, 1)
    if pack.total_rows % world:
        raise ValueError(f"a pack of {pack.total_rows} rows does not split over {world} ranks")
    lo, hi = rank * pack.total_rows // world, (rank + 1) * pack.total_rows // world

    # The prologue (1-3) is row-local: no collective. Under Ulysses its error (a bad row, an OOM) is carried to the
    # agreement below, so every rank leaves the step there. Inline, not a helper: its tensors stay live through the
    # blocks as before, which the memory plan (ACTIVATION_FORMULA) and its meta-device check count.
    failure: Exception | None = None
    try:
        # 1. Text: context embedder, then the token refiner with attention within each request's prompt.
        # Every rank refines all prompts: text is a few hundred rows against tens of thousands of media rows.
        text = model.context_embedder(pack.prompt_embeds.to(get_parameter_dtype(model.context_embedder)))[None]
        with attending(Documents(pack.text_cu_seqlens, pack.text_max_seqlen)):
            text = model.token_refiner(text)  # [1, N_text, hidden]

        # 2. This rank's rows of the packed buffer, each modality through its own (fp32) input projection.
        hidden = text.new_zeros((1, hi - lo, text.shape[-1]))  # [1, T/W, hidden]; padding rows stay zero
        text_at, text_rows = _local(pack.text_indices, text[0], lo, hi, pack.total_rows)
        video_at, video_rows = _local(pack.video_indices, pack.video_rows, lo, hi, pack.total_rows)
        audio_at, audio_rows = _local(pack.audio_indices, pack.audio_rows, lo, hi, pack.total_rows)
        video = model.proj_in(video_rows.to(get_parameter_dtype(model.proj_in)))
        audio = model.audio_proj_in(audio_rows.to(get_parameter_dtype(model.audio_proj_in)))
        hidden = hidden.index_copy(1, text_at, text_rows[None])
        hidden = hidden.index_copy(1, video_at, video.to(text.dtype)[None])
        hidden = hidden.index_copy(1, audio_at, audio.to(text.dtype)[None])

        # 3. One embedding per distinct timestep of the pack; each row picks its AdaLN table row.
        temb = model.time_proj(pack.timestep)
        temb = model.time_embedder(temb.to(get_parameter_dtype(model.time_embedder)))  # [K, time_embed_dim]
        timestep_indices = pack.timestep_indices[lo:hi]  # [T/W]
        adaln_indices = timestep_indices * MINIMAX_H3_MODALITY_NUM + pack.token_tags[lo:hi]  # video 0, text 1, audio 2
        rotary_emb = model.rope(pack.position_ids[lo:hi])  # cos, sin: [T/W, 6 * rope_freq_dim]
        sharded = None
        if cache is not None and sp is not None and world > 1:  # a sub-pack's rows are anywhere: every row's index
            pack_adaln = pack.timestep_indices * MINIMAX_H3_MODALITY_NUM + pack.token_tags  # [T]
            inner = model.config.num_attention_heads * model.config.attention_head_dim  # what an all-to-all carries
            sharded = ShardedRows(sp, pack_adaln, model.rope, inner)
    except Exception as e:
        if sp is None or world == 1:
            raise
        failure = e
    if sp is not None and world > 1:
        sp.agree(failure)  # one collective, before any that depends on the data; raises on every rank on a failure

    # Past the agreement an out-of-memory (a block's SwiGLU is the step's peak) is the pack's, not the group's: this
    # rank enters the collectives left in its step with scratch buffers, then raises it (``sp.drain``), so every peer
    # finishes the step and rank 0 fails the pack, which the engine retries in halves. No cost while nothing fails: no
    # collective or host sync is added. A step cache's collectives depend on decisions made mid-step: its blocks enter
    # theirs themselves, hollow (``step_cache._Hollow``), and a step-caching step ends with one agreement on its
    # outcome (a flag per rank, where the step's end waits on the device anyway) so that no rank commits a step
    # another rank failed.
    block_dtype = hidden.dtype  # what the blocks' all-to-alls carry
    try:
        with attending(Documents(pack.cu_seqlens, pack.max_seqlen, sp)):
            if cache is None:
                for block in model.transformer_blocks:
                    hidden = block(hidden, temb, adaln_indices, rotary_emb)
            else:  # each document runs the middle blocks only when its first blocks' residual changed enough
                hidden = cached_blocks(
                    model.transformer_blocks, hidden, temb, adaln_indices, rotary_emb, pack, cache, sharded
                )
        hidden = model.norm_out(hidden, temb, timestep_indices).to(get_parameter_dtype(model.proj_out))[0]  # [T/W, d]

        # 4. Each head on its own modality's rows, on the rank that holds them.
        video_out = model.proj_out(hidden.index_select(0, video_at))  # [n_video here, C_video]
        audio_out = model.audio_proj_out(hidden.index_select(0, audio_at))  # [n_audio here, C_audio]
        if sp is None or world == 1:
            if cache is not None:
                cache.commit()  # the forward succeeded: every document's step enters its state
            return video_out, audio_out  # every row is here, already in the pack's video/audio order

        # 5. Rank 0 gathers the projected rows, not the hidden state: [T/W, max(C_video, C_audio)] per rank
        # instead of [T/W, hidden]: 96 columns (video 24 x 2 x 2 patch; audio 32) instead of 5376 when released.
        c_video, c_audio = video_out.shape[1], audio_out.shape[1]
        local = hidden.new_zeros((hi - lo, max(c_video, c_audio)))  # text and padding rows stay zero
        local[:, :c_video].index_copy_(0, video_at, video_out)
        local[:, :c_audio].index_copy_(0, audio_at, audio_out)
        rows = sp.gather_rows(local)  # [T, max(C_video, C_audio)] on rank 0
        out = None
        if rows is not None:
            velocities = rows.index_select(0, pack.video_indices)[:, :c_video]  # [N_video, C_video]
            out = velocities, rows.index_select(0, pack.audio_indices)[:, :c_audio]
        if cache is not None:
            # last (nothing that allocates after it): a rank out of memory went on hollow and drained to here, so
            # every rank commits the same step, or none does
            sp.agree(None)
            cache.commit()
        return out
    except torch.OutOfMemoryError as e:
        if sp is None or world == 1:
            raise
        e.__traceback__ = None  # its frames hold the failed block's activations: they go before the scratch comes
        del hidden, temb, rotary_emb, text, video, audio, video_rows, audio_rows
        sp.drain(
            e,
            blocks=len(model.transformer_blocks) if cache is None else 0,  # a step cache's: entered, hollow or not
            rows=hi - lo,
            inner=model.config.num_attention_heads * model.config.attention_head_dim,  # heads x head_dim
            dtype=block_dtype,
            columns=max(model.proj_out.out_features, model.audio_proj_out.out_features),
            gather_dtype=get_parameter_dtype(model.proj_out),
            then_agree=cache is not None,
        )
        raise  # drain raises ``e``; never reached
