"""A MiniMax-H3 checkpoint directory in the released layout: read it strictly, offline; write a tiny one.

The released repository is a diffusers modular repository::

    modular_model_index.json  transformer/  transformer_ref/  vae/  audio_vae/  text_encoder/
    tokenizer/  processor/  scheduler/  audio_scheduler/

Every component loads with its library's own ``from_pretrained`` from ``<directory>/<subfolder>``,
never from the hub: the repository ids inside the index are ignored, only its class names and
canvas configs are read. A component whose weights do not fit its class (missing, unexpected or
mis-shaped keys) is refused with the first keys and the folder named; nothing is re-initialised.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from .config import TINY_VOCAB_SIZE, TransformerGeometry, preset, transformer_defaults
from .paths import cache_dir
from .request import VisionUnavailable

logger = logging.getLogger(__name__)

INDEX_FILE = "modular_model_index.json"
# subfolder -> (library, class name the index must declare)
LAYOUT: dict[str, tuple[str, str]] = {
    "transformer": ("diffusers", "MiniMaxH3Transformer3DModel"),
    "transformer_ref": ("diffusers", "MiniMaxH3Transformer3DModel"),
    "vae": ("diffusers", "AutoencoderKLMiniMaxH3"),
    "audio_vae": ("diffusers", "AutoencoderKLMiniMaxH3Audio"),
    "text_encoder": ("transformers", "Qwen3VLForConditionalGeneration"),
    "tokenizer": ("transformers", "Qwen2Tokenizer"),
    "processor": ("transformers", "Qwen3VLProcessor"),
    "scheduler": ("diffusers", "MiniMaxH3Scheduler"),
    "audio_scheduler": ("diffusers", "MiniMaxH3Scheduler"),
}
OPTIONAL = ("transformer_ref",)  # Ref2VA's partition; a checkpoint without it serves t2va and fl2va
# The partition each workflow denoises with.
PARTITIONS = {"t2va": "transformer", "fl2va": "transformer", "ref2va": "transformer_ref"}
_LISTED = 5


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served as it is. The message names the folder or file."""


class CheckpointIndex:
    """What ``modular_model_index.json`` declares: which components exist, and the blocks' configs."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        path = self.directory / INDEX_FILE
        if not path.is_file():
            raise CheckpointError(f"{self.directory} is not a MiniMax-H3 checkpoint: it has no {INDEX_FILE}")
        try:
            self.raw: dict[str, Any] = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from None
        if self.raw.get("_class_name") != "MiniMaxH3ModularPipeline":
            raise CheckpointError(f"{path} declares {self.raw.get('_class_name')!r}, not MiniMaxH3ModularPipeline")

    def declared(self, name: str) -> bool:
        """Whether the index names a loadable component under ``name`` (its library is not null)."""
        entry = self.raw.get(name)
        return isinstance(entry, list) and len(entry) == 3 and entry[0] is not None

    @property
    def pipeline_config(self) -> dict[str, Any]:
        """The blocks' configs (canvas short edge, area cap...): the index's plain values."""
        return {k: v for k, v in self.raw.items() if not k.startswith("_") and not isinstance(v, list)}

    def folder(self, name: str) -> Path:
        """The component's folder, after checking the index declares it with the class h3serve serves."""
        library, class_name = LAYOUT[name]
        if not self.declared(name):
            raise CheckpointError(f"{self.directory} has no {name!r} component ({INDEX_FILE} does not declare one)")
        declared = tuple(self.raw[name][:2])
        accepted = {(library, class_name)} | ({(library, "Qwen2TokenizerFast")} if name == "tokenizer" else set())
        if declared not in accepted:
            raise CheckpointError(
                f"{INDEX_FILE} declares {name} as {declared[0]}.{declared[1]}; h3serve serves {library}.{class_name}"
            )
        folder = self.directory / name
        if not folder.is_dir():
            raise CheckpointError(f"{folder} is missing (the index declares {name!r})")
        return folder

    def partitions(self) -> tuple[str, ...]:
        return tuple(p for p in ("transformer", "transformer_ref") if self.declared(p))


# Model components whose config.json admission reads besides the partitions: the memory plan counts their weights,
# and their latent and text widths must be what the transformer takes.
CONFIG_COMPONENTS = ("vae", "audio_vae", "text_encoder")


def load_component_config(index: CheckpointIndex, name: str) -> dict[str, Any]:
    """A model component's config.json through its library's config loader (no weights), or CheckpointError."""
    import diffusers
    import transformers

    folder = index.folder(name)
    library, class_name = LAYOUT[name]
    try:
        if library == "diffusers":
            return dict(getattr(diffusers, class_name).load_config(folder, local_files_only=True))
        return getattr(transformers, class_name).config_class.from_pretrained(folder, local_files_only=True).to_dict()
    except (OSError, ValueError) as e:  # missing or unparsable config.json
        raise CheckpointError(f"{folder} has no readable {class_name} config: {e}") from None


class CheckpointConfigs(BaseModel):
    """A checkpoint directory's component configs, read without weights: what admission checks and the memory plan
    counts. The driver reads them where it holds the directory, else the probe on a replica node (``read_on``)."""

    model_config = ConfigDict(frozen=True)

    directory: str
    read_on: str  # where they were read: "the driver", "replica node 10.0.0.3"
    partitions: tuple[str, ...]  # "transformer", and "transformer_ref" where the checkpoint has Ref2VA
    configs: dict[str, dict[str, Any]]  # component folder -> its config (every partition and CONFIG_COMPONENTS)

    @classmethod
    def read(cls, directory: str | Path, read_on: str) -> CheckpointConfigs:
        """Every component the replicas load must be declared with its class and have its folder; the partitions'
        and CONFIG_COMPONENTS' configs are read. CheckpointError names the folder otherwise."""
        index = CheckpointIndex(directory)
        partitions = index.partitions()
        configs = {}
        for name in LAYOUT:
            if name in OPTIONAL and name not in partitions:
                continue
            index.folder(name)  # declared with the class h3serve serves, and present
            if name in partitions or name in CONFIG_COMPONENTS:
                configs[name] = load_component_config(index, name)
        return cls(directory=str(index.directory), read_on=read_on, partitions=partitions, configs=configs)

    def transformer(self, partition: str = "transformer") -> dict[str, Any]:
        """A partition's whole config: the class's defaults under what its config.json sets."""
        return {**transformer_defaults(), **self.configs[partition]}

    def geometry(self, partition: str = "transformer") -> TransformerGeometry:
        return TransformerGeometry.of(self.transformer(partition))

    def where(self, partition: str = "transformer") -> str:
        return f"{Path(self.directory) / partition} (read on {self.read_on})"


@contextlib.contextmanager
def _library_deprecations_silenced():
    """diffusers' audio VAE builds with torch's old weight_norm, which warns on every construction."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*weight_norm.*", category=FutureWarning)
        yield


def _refuse_mismatches(folder: Path, info: dict[str, list]) -> None:
    problems = []
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = [k if isinstance(k, str) else k[0] for k in info.get(kind) or []]
        if keys:
            more = f" and {len(keys) - _LISTED} more" if len(keys) > _LISTED else ""
            problems.append(f"{kind.replace('_', ' ')}: {', '.join(keys[:_LISTED])}{more}")
    if info.get("error_msgs"):
        problems.append("; ".join(info["error_msgs"][:_LISTED]))
    if problems:
        files = ", ".join(sorted(p.name for p in folder.glob("*.safetensors*"))) or "no safetensors files"
        raise CheckpointError(f"{folder} ({files}) does not fit its class: " + "; ".join(problems))


def load_model(
    index: CheckpointIndex,
    name: str,
    dtype: torch.dtype,
    device: str | torch.device,
    *,
    text_layers: int | None = None,
):
    """One model component (transformer, VAE, text encoder), strictly: every key present, none extra.

    Straight to ``device``: the libraries' ``device_map`` builds the module on the ``meta`` device and reads each
    safetensors tensor onto ``device``, so no host copy of the model is made and then moved (on a GPU the host copy
    of the released checkpoint is ~124 GB through pageable memory). ``meta`` itself loads the structure only.
    ``text_layers`` (the text encoder only): build just the first ``text_layers`` Qwen3-VL decoder layers and never
    read the later ones' weights (``keep_decoder_layers`` says why); their keys are the only ones allowed unread.
    """
    import diffusers
    import transformers

    folder = index.folder(name)
    library, class_name = LAYOUT[name]
    cls = getattr(diffusers if library == "diffusers" else transformers, class_name)
    device = torch.device(device)
    kwargs: dict[str, Any] = {"torch_dtype": dtype} if library == "diffusers" else {"dtype": dtype}
    unread: tuple[str, ...] = ()
    if text_layers is not None:
        if name != "text_encoder":
            raise ValueError(f"text_layers applies to the text encoder, not {name}")
        config = cls.config_class.from_pretrained(folder, local_files_only=True)
        text_config = config.text_config
        if text_config.num_hidden_layers > text_layers:
            later = range(text_layers, text_config.num_hidden_layers)
            unread = tuple(f"model.language_model.layers.{i}." for i in later)
            text_config.num_hidden_layers = text_layers
            if getattr(text_config, "layer_types", None):
                text_config.layer_types = text_config.layer_types[:text_layers]
        kwargs["config"] = config

    def load(onto: torch.device):
        # hub kernels refuse the meta device, and there is nothing to run there
        meta = {"use_kernels": False} if library == "transformers" and onto.type == "meta" else {}
        with _library_deprecations_silenced():
            return cls.from_pretrained(
                folder, output_loading_info=True, local_files_only=True, device_map=str(onto), **kwargs, **meta
            )

    def refuse_mismatches(info: dict) -> None:
        if unread:
            info = dict(
                info, unexpected_keys=[k for k in info.get("unexpected_keys") or [] if not k.startswith(unread)]
            )
        _refuse_mismatches(folder, info)

    try:
        model, info = load(device)
    except (OSError, ValueError, RuntimeError) as e:  # wrong shapes, unreadable files, a weight left on meta
        if device.type != "meta":  # a missing key fails the move to the device: name the keys, as meta loads them
            try:
                meta_info = load(torch.device("meta"))[1]
            except (OSError, ValueError, RuntimeError):
                meta_info = None
            if meta_info is not None:
                refuse_mismatches(meta_info)
        raise CheckpointError(f"{folder} cannot be loaded as {class_name}: {e}") from None
    refuse_mismatches(info)
    return model.eval()


def keep_decoder_layers(text_encoder, count: int) -> None:
    """Drop the Qwen3-VL decoder layers after the first ``count``: H3 reads an inner hidden state.

    The released conditioner's later layers never influence ``hidden_states[50]``; keeping them would
    hold ~13 GB of GPU memory on rank 0 for nothing. (``load_model(text_layers=)`` never builds them.)
    """
    language_model = text_encoder.model.language_model
    if len(language_model.layers) > count:
        language_model.layers = language_model.layers[:count]
        text_encoder.config.text_config.num_hidden_layers = count


def load_scheduler(index: CheckpointIndex, name: str):
    from diffusers import MiniMaxH3Scheduler

    return MiniMaxH3Scheduler.from_pretrained(index.folder(name), local_files_only=True)


def load_tokenizer(index: CheckpointIndex):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(index.folder("tokenizer"), local_files_only=True)


class ImageOnlyQwen3VLProcessor:
    """Qwen3-VL's processor where torchvision is missing: its tokenizer and its PIL image processor.

    transformers builds ``Qwen3VLProcessor`` (and its video processor) only with torchvision, which
    has no build for this CPU torch. Text and keyframes need just these two parts; a video reference
    needs the video processor, and asking for it says so.
    """

    image_token, video_token = "<|image_pad|>", "<|video_pad|>"

    def __init__(self, tokenizer, image_processor):
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)

    @property
    def video_processor(self):
        raise VisionUnavailable(
            "video references need Qwen3-VL's video processor, which needs torchvision; "
            "it is not installed on this replica"
        )

    def create_mm_token_type_ids(self, input_ids: list[list[int]]) -> list[list[int]]:
        """Qwen-internal token types, as ``ProcessorMixin`` defines them: 0 text, 1 image, 2 video."""
        kinds = {self.image_token_id: 1, self.video_token_id: 2}
        return [[kinds.get(token, 0) for token in row] for row in input_ids]


def load_processor(index: CheckpointIndex):
    """Qwen3-VL's processor; without torchvision, the tokenizer and image processor it is made of."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLProcessor
    from transformers.utils import is_torchvision_available

    folder = index.folder("processor")
    if is_torchvision_available():
        return Qwen3VLProcessor.from_pretrained(folder, local_files_only=True)
    logger.warning("torchvision is not installed: %s serves text and keyframes, not video references", folder)
    return ImageOnlyQwen3VLProcessor(
        AutoTokenizer.from_pretrained(folder, local_files_only=True),
        AutoImageProcessor.from_pretrained(folder, local_files_only=True),
    )


# ----------------------------------------------------------------------------- the tiny checkpoint

# The words the tiny tokenizer learns as whole pieces: the demo world's vocabulary and the README's prompts.
TOKENIZER_CORPUS = (
    "a an the with and of on in at to moving still left right up down circle square triangle red green blue "
    "yellow magenta cyan white black orange purple low hum high beep silence silent quiet shape lighthouse "
    "dusk waves beach fox robot dancing sea sky night day city street forest river mountain"
)
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


def tiny_tokenizer():
    """A byte-level BPE tokenizer in Qwen2's format, learned from a fixed corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    words = TOKENIZER_CORPUS.split()
    bpe.train_from_iterator([" ".join(words)] + [f" {w}" for w in words] * 4, trainer)
    return Qwen2TokenizerFast(
        tokenizer_object=bpe, bos_token=None, eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token=None
    )


def tiny_processor(tokenizer):
    """``Qwen3VLProcessor`` of the tiny text encoder, built from its parts.

    ``ProcessorMixin.__init__`` type-checks the video processor against a class transformers only
    exports with torchvision, so the attributes it would set are set here and the library's own
    ``save_pretrained`` writes the folder.
    """
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    spec = preset("tiny").components["processor"]
    processor = object.__new__(Qwen3VLProcessor)
    processor.tokenizer = tokenizer
    processor.image_processor = Qwen2VLImageProcessorPil(**spec)
    processor.video_processor = Qwen3VLVideoProcessor(
        patch_size=spec["patch_size"], merge_size=spec["merge_size"], temporal_patch_size=spec["temporal_patch_size"]
    )
    processor.chat_template = None
    return processor


def keep_tokens_apart(text_encoder) -> None:
    """Scale the tiny Qwen3-VL's random weights so ``hidden_states[50]`` keeps its prompt's tokens apart.

    With the library's initialisation (embeddings and every projection at std 0.02), the 51 residual
    branches add outputs as large as the embeddings they are added to, and layer 50 collapses every token
    toward one direction: the two prompts of ``benchmarks.text_encoder`` had per-position cosine 0.86
    there against 0.38 at the embeddings, and a prompt's own tokens 0.77 against each other. Two rescalings,
    neither drawing random numbers (every other component keeps its tensors for a seed):

    - the token embeddings to unit RMS, the scale of a trained LLM's inner hidden states, which H3's
      ``context_embedder`` was made for: at std 0.02 its bias outweighs the tokens (cosine 0.99 after it);
    - the residual branches' output projections (``self_attn.o_proj``, ``mlp.down_proj``) by
      1/sqrt(2 * layers), GPT-2's scaled residual initialisation, so 51 layers add a small perturbation.

    Layer 50 then stays within a few hundredths of the embeddings' similarities (measured in
    ``benchmarks.text_encoder``), and the layers stay trainable (no weight is zero).
    """
    language_model = text_encoder.model.language_model
    branch_scale = 1 / math.sqrt(2 * len(language_model.layers))
    with torch.no_grad():
        embeddings = language_model.embed_tokens.weight  # [vocab, hidden], tied to the (unused) lm_head
        embeddings.div_(embeddings.pow(2).mean().sqrt())
        for layer in language_model.layers:
            layer.self_attn.o_proj.weight.mul_(branch_scale)
            layer.mlp.down_proj.weight.mul_(branch_scale)


def tiny_components(
    seed: int = 0,
    with_ref: bool = False,
    library_text_init: bool = False,
    transformer: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every component of the tiny preset, built by its library class with seeded random weights.

    ``library_text_init``: leave the text encoder as transformers initialises it, without
    ``keep_tokens_apart`` (the writer before it; ``benchmarks.text_encoder`` measures both).
    ``transformer``: transformer config values over the preset's (a checkpoint of other dims: heads, head size,
    layers, hidden size; its widths facing the VAEs and the text encoder stay the preset's).
    """
    from diffusers import (
        AutoencoderKLMiniMaxH3,
        AutoencoderKLMiniMaxH3Audio,
        MiniMaxH3Scheduler,
        MiniMaxH3Transformer3DModel,
    )
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    spec = preset("tiny")
    transformer_config = {**spec.transformer, **(transformer or {})}
    tokenizer = tiny_tokenizer()
    token_ids = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in (
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
        )
    }
    text = spec.components["text_encoder"]
    text_config = Qwen3VLConfig(
        text_config={**text["text_config"], "vocab_size": len(tokenizer)},
        vision_config=text["vision_config"],
        tie_word_embeddings=text["tie_word_embeddings"],
        **token_ids,
    )
    torch.manual_seed(seed)
    with _library_deprecations_silenced():
        components = dict(
            transformer=MiniMaxH3Transformer3DModel(**transformer_config),
            vae=AutoencoderKLMiniMaxH3(**spec.components["vae"]),
            audio_vae=AutoencoderKLMiniMaxH3Audio(**spec.components["audio_vae"]),
            text_encoder=Qwen3VLForConditionalGeneration(text_config),
            tokenizer=tokenizer,
            processor=tiny_processor(tokenizer),
            scheduler=MiniMaxH3Scheduler(**spec.components["scheduler"]),
            audio_scheduler=MiniMaxH3Scheduler(**spec.components["audio_scheduler"]),
        )
        if with_ref:
            components["transformer_ref"] = MiniMaxH3Transformer3DModel(**transformer_config)
    if not library_text_init:
        keep_tokens_apart(components["text_encoder"])
    return components


def save_checkpoint(
    components: dict[str, Any],
    directory: str | Path,
    pipeline_config: dict[str, Any],
    repo_id: str = "h3serve/minimax-h3-tiny",
) -> Path:
    """Write components in the released layout with diffusers' ``ModularPipeline.save_pretrained``.

    The index records ``repo_id`` as every component's source, the shape of the released index;
    h3serve itself always reads the folders next to the index.
    """
    from diffusers.modular_pipelines import MiniMaxH3Blocks

    directory = Path(directory)
    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.register_to_config(**pipeline_config)
    pipe.update_components(**components)
    pipe.save_pretrained(str(directory), overwrite_modular_index=True)
    index_path = directory / INDEX_FILE
    index = json.loads(index_path.read_text())
    for entry in index.values():  # save_pretrained records this machine's absolute path
        if isinstance(entry, list) and entry[0] is not None:
            entry[2]["pretrained_model_name_or_path"] = repo_id
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return directory


def write_tiny_checkpoint(
    directory: str | Path, seed: int = 0, with_ref: bool = False, transformer: dict[str, Any] | None = None
) -> Path:
    """The tiny preset with random weights, the same tensors for a given seed and torch. ``transformer``: config
    values over the preset's transformer (``tiny_components``)."""
    components = tiny_components(seed, with_ref, transformer=transformer)
    return save_checkpoint(components, directory, preset("tiny").pipeline_config)


# Bump when the tiny writer makes other tensors for the same preset and seed, so no cache serves the old ones.
# 2: the text encoder keeps tokens apart (keep_tokens_apart).
TINY_WRITER_VERSION = 2


def random_tiny_checkpoint(seed: int = 0) -> Path:
    """The tiny preset with seeded random weights, written once into the cache (any process may race)."""
    import shutil
    import tempfile

    # the preset's values and the writer's version are in the name: a changed tiny preset or writer never
    # loads an old cached checkpoint
    digest = hashlib.sha256(repr((TINY_WRITER_VERSION, preset("tiny"))).encode()).hexdigest()[:10]
    target = cache_dir() / f"minimax-h3-tiny-random-{seed}-{digest}"
    if (target / INDEX_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        write_tiny_checkpoint(staging, seed)
        os.rename(staging, target)  # atomic; loses to a process that got there first
    except OSError:
        if not (target / INDEX_FILE).is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# The built-in tiny checkpoint: the tiny MiniMax-H3 trained on the demo world (``python -m h3serve.demo.train``; its
# recipe, seeds and losses in its training.json), shipped in the released layout as package data.
BUILT_IN_TINY = Path(__file__).parent / "checkpoints" / "minimax-h3-tiny-demo"


def built_in_tiny_checkpoint() -> Path:
    """The shipped trained tiny checkpoint; refused by name where an install left it out (never replaced by
    random weights: a server making noise from a missing file would look like a broken model)."""
    if not (BUILT_IN_TINY / INDEX_FILE).is_file():
        raise CheckpointError(
            f"the built-in tiny checkpoint is not in this install ({BUILT_IN_TINY / INDEX_FILE} is missing): set "
            "checkpoint to a checkpoint directory, or write the tiny preset with random weights (`h3serve weights`)"
        )
    return BUILT_IN_TINY


def resolve_checkpoint(checkpoint: str | Path | None) -> Path:
    """The directory to serve: the given one, or for none the built-in (trained) tiny checkpoint."""
    if checkpoint is not None:
        return Path(checkpoint)
    return built_in_tiny_checkpoint()
