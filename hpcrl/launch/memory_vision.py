"""The "images" row of a trainer rank's memory plan ([model.vlm]): the vision encoder's activations
for the images of one micro-batch (hpcrl sft's plan, hpcrl.launch.memory_sft; usable by the RL plan
with the same arguments).

    item, trained_extra = vlm_image_item(model_name, vlm, seq_len, "bfloat16")  # None: not local
    # its parts: image_geometry (preprocessor_config.json, else the release's), image_item

Patches of a micro-batch. A Qwen-VL image processor resizes an image so that its sides are
multiples of p x m (patch_size x merge_size) and its area at most max_pixels (``size.longest_edge``,
or the older ``max_pixels`` key), so one image holds at most P = floor(max_pixels / (p m)^2) x m^2
patches of p x p pixels (each a C x t x p x p voxel: a still image is repeated over
temporal_patch_size t) and T = P / m^2 image tokens. A VLM micro-batch is one sample of at most S =
seq_len tokens, and a sample never keeps an image whose tokens the cut would split, so its image
tokens are at most S: N = S x m^2 patches, the worst case (S // T images of max_pixels and smaller
ones in the rest; with T > S an image of max_pixels never fits, and the note says so).

What they cost, per patch, in compute-dtype elements (E the tower's width, I its MLP width, O its
output width, D its depth, k the deepstack mergers of Qwen3-VL):
  trained tower (model.vlm.freeze_vision_encoder = false): what autograd saves for the backward,
      the patch embed's input C t p^2 + D x (VIS_BLOCK_E x E + VIS_MLP x I) + VIS_MERGER x E x (1 + k)
      (VIS_BLOCK_E: two norms' inputs and outputs 4E, qkv 3E, the rotated q and k 2E, the attention
      output E; VIS_MLP: fc1 and its activation 2, Qwen2.5-VL's gated MLP 4 as the text model's
      ACT_MLP; a merger: its norm's input and output, fc1's output, the activation's, 4E per patch).
      Counted, not calibrated; attention with a flash kernel (no [n, n] scores). With [model.ac]
      in full mode the trained tower's blocks are checkpointed too (every freq-th:
      hpcrl.trainer.memory_savers.checkpoint_vision_blocks): c = ceil(D / freq) blocks keep only
      their input E, the others what they save, and one block is recomputed at a time:
      C t p^2 + c x E + (D - c + 1) x block + the mergers. Selective mode leaves the tower alone.
  frozen tower (the default; LoRA keeps it frozen): no parameter of the tower asks for a gradient
      and the pixels do not, so autograd saves nothing; the forward's transient peak is one block's
      working set, max(7E for attention: residual, qkv, rotated q and k, output; 2E + 2I for the MLP:
      residual, its input, fc1, activation) + the pixels C t p^2 + the features handed to the
      language model (1 + k) x O / m^2.
The row is that (N x elements x compute bytes); the text model's activations are their own row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpcrl.launch.memory_units import BYTES, GIB, SHORT, Item
from hpcrl.launch.memory_units import count as _count

VIS_BLOCK_E = 10  # 4 (norms in/out) + 3 (qkv) + 2 (rotated q, k) + 1 (attention output)
VIS_MLP = {"qwen2_5_vl": 4}  # gate, up, silu(gate), silu(gate) * up; others fc1 + GELU: 2
VIS_MERGER = 4  # norm in, norm out, fc1 out, activation out (per patch, E wide)
RELEASE_TOKENS = 16384  # the Qwen-VL releases' max_pixels: 16384 image tokens, (p x m)^2 pixels each
DEFAULT_PATCH = {"qwen2_vl": 14, "qwen2_5_vl": 14, "qwen3_vl": 16, "qwen3_5": 16}


@dataclass(frozen=True)
class ImageGeometry:
    max_pixels: int
    patch: int
    merge: int
    temporal: int
    source: str  # where the numbers come from (the dry run's note)

    @property
    def patches(self) -> int:
        """Patches of the largest image (P): its p x m cells at most max_pixels, m^2 patches each."""
        return max(1, self.max_pixels // (self.patch * self.merge) ** 2) * self.merge**2

    @property
    def tokens(self) -> int:
        return self.patches // self.merge**2


def image_geometry(name: str | None, family: str, processor: dict[str, Any] | None = None) -> ImageGeometry:
    """A model's image geometry from its preprocessor_config.json (`processor`; read from the model
    directory or the HF cache when None), else the release's for the family (16384 tokens an image)."""
    if processor is None:
        from hpcrl.models.arch import local_config

        processor = local_config(name, filename="preprocessor_config.json")
    patch = DEFAULT_PATCH.get(family, 16)
    if not processor:
        return ImageGeometry(RELEASE_TOKENS * (patch * 2) ** 2, patch, 2, 2, f"{family}'s release defaults")
    p = int(processor.get("patch_size") or patch)
    m = int(processor.get("merge_size") or 2)
    size = processor.get("size") if isinstance(processor.get("size"), dict) else {}
    most = processor.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
    most = int(most) if most else RELEASE_TOKENS * (p * m) ** 2
    t = int(processor.get("temporal_patch_size") or 2)
    return ImageGeometry(most, p, m, t, "preprocessor_config.json")


def micro_batch_patches(images: ImageGeometry, seq_len: int) -> tuple[int, str]:
    """N, the patches of one micro-batch's images (module docstring), and how seq_len holds them."""
    n = seq_len * images.merge**2
    whole = seq_len // images.tokens
    if whole:
        rest = seq_len - whole * images.tokens
        how = f"{whole} image(s) of max_pixels {images.max_pixels} ({images.patches} patches, {images.tokens} tokens each)"
        return n, how + (f" + smaller ones in the last {rest} tokens" if rest else "")
    how = (
        f"an image of max_pixels {images.max_pixels} needs {images.tokens} tokens > seq_len {seq_len} "
        "(dropped from its sample); smaller ones fill seq_len"
    )
    return n, how


def per_patch(
    family: str, g: dict[str, Any], images: ImageGeometry, trained: bool, ckpt_freq: int = 0
) -> int:
    """Compute-dtype elements per patch (module docstring); ``ckpt_freq`` > 0: every ckpt_freq-th
    block checkpointed."""
    qwen2 = family == "qwen2_vl"
    e = int(g["embed_dim"] if qwen2 else g["hidden_size"])
    out = int(g["hidden_size"] if qwen2 else g["out_hidden_size"])
    inter = int(e * g["mlp_ratio"]) if qwen2 else int(g["intermediate_size"])
    depth = int(g["depth"])
    deep = len(g.get("deepstack_visual_indexes") or []) if family == "qwen3_vl" else 0
    voxel = int(g["in_channels"]) * images.temporal * images.patch**2
    block = VIS_BLOCK_E * e + VIS_MLP.get(family, 2) * inter
    if not trained:
        return voxel + max(7 * e, 2 * e + 2 * inter) + (1 + deep) * out // images.merge**2
    mergers = VIS_MERGER * e * (1 + deep)
    if ckpt_freq:
        c = -(-depth // ckpt_freq)
        return voxel + c * e + (depth - c + 1) * block + mergers
    return voxel + depth * block + mergers


def image_item(
    config: dict[str, Any] | None,
    images: ImageGeometry | None,
    *,
    seq_len: int,
    compute: str,
    trained: bool,
    ckpt_freq: int = 0,
) -> tuple[Item | None, float]:
    """The "images" row and what freezing the tower would save on it (0 when frozen); (None, 0)
    without a vision_config hpcrl counts. `config`: the model's config.json dict."""
    from hpcrl.models.arch import vision_config

    found = vision_config(config or {})
    if found is None or images is None:
        return None, 0.0
    family, g = found
    n, how = micro_batch_patches(images, seq_len)
    cb = BYTES[compute]
    gib = n * per_patch(family, g, images, trained, ckpt_freq if trained else 0) * cb / GIB
    frozen_gib = n * per_patch(family, g, images, False) * cb / GIB
    what = (
        "trained: saved for the backward, every block (no full-mode [model.ac])"
        if trained and not ckpt_freq
        else f"trained: blocks checkpointed (every {ckpt_freq})"
        if trained
        else "frozen: nothing saved, the forward's peak"
    )
    note = f"{n} patches of a micro-batch: {how}; {what}; p {images.patch}, m {images.merge} from {images.source}"
    return Item("images", SHORT[compute], gib, note), gib - frozen_gib if trained else 0.0


def vlm_image_item(
    name: str | None, vlm: object, seq_len: int, compute: str, ckpt_freq: int = 0
) -> tuple[Item | None, float]:
    """The "images" row of a trainer rank with [model.vlm] `vlm` (hpcrl.launch.memory_vision) from the
    model's local config.json and preprocessor_config.json; (None, 0) where they are not local.
    ``ckpt_freq``: full-mode [model.ac]'s freq (0: none)."""
    from hpcrl.models.arch import local_config, vision_config

    config = local_config(name)
    found = vision_config(config or {})
    if vlm is None or found is None:
        return None, 0.0
    trained = not bool(getattr(vlm, "freeze_vision_encoder", True))
    images = image_geometry(name, found[0])
    return image_item(config, images, seq_len=seq_len, compute=compute, trained=trained, ckpt_freq=ckpt_freq)


def expert_lora_params(arch: Any, lora: Any) -> int:
    """Parameters of [model.lora]'s "experts" target on a VL MoE (hpcrl.models.vlm_moe: per expert
    A_gu r x H, B_gu 2I x r, A_d r x I, B_d H x r): MoE layers x E x r x (2H + 3I); 0 without it."""
    if lora is None or "experts" not in lora.target_modules or not arch.moe:
        return 0
    layers = arch.layers if arch.sparse_layers is None else arch.sparse_layers
    return layers * arch.num_experts * lora.rank * (2 * arch.hidden + 3 * arch.moe_intermediate)


def vlm_rows(
    trainer: list[Item], arch: Any, vlm: object, kw: dict, *, name: str | None, seq_len: int, states: int
) -> float:
    """With [model.vlm] `vlm`: the "vision encoder" and "images" rows put into a trainer rank's
    `trainer` items after "gathered" (memory_plan.trainer_items'; `kw` its arguments); returns what
    freezing the tower would save (0 when frozen). The SFT plan and the RL plan both call it."""
    vision, trained = vision_item(arch, vlm, kw, states)
    if vision is None:
        return 0.0
    at = next(n for n, i in enumerate(trainer) if i.name == "gathered") + 1
    trainer.insert(at, vision)
    full_ac = kw.get("ac_freq", 0) if not kw.get("ac_targets") else 0  # trainer_kw's: set with [model.ac]
    images, trained_images = vlm_image_item(name, vlm, seq_len, kw["compute"], full_ac)
    if images is not None:
        trainer.insert(at + 1, images)
    return trained + trained_images


def vision_item(arch: Any, vlm: object, kw: dict, states: int) -> tuple[Item | None, float]:
    """The "vision encoder" row of a trainer rank (see the module docstring) and what freezing the
    encoder would save (0 when frozen); (None, 0) without [model.vlm] or a counted vision tower.
    `kw`: trainer_kw's arguments (ranks, dtypes, optimizer); `states`: the optimizer's states a
    parameter (memory_plan.OPTIMIZER_STATES)."""
    v = arch.vision_params
    if vlm is None or not v:
        return None, 0.0
    ranks, master, compute = kw["ranks"], kw["master"], kw["compute"]
    shard = v / ranks * BYTES[master] / GIB
    gathered = v * BYTES[compute] / GIB
    frozen = bool(getattr(vlm, "freeze_vision_encoder", True))
    moments = 0 if kw.get("optimizer_on_host") else states
    trained = 0.0 if frozen else shard * (1 + moments)
    dtype = SHORT[master] if master == compute else "mixed"
    how = (
        "frozen: no gradients, no optimizer state"
        if frozen
        else f"trained: + gradients + {moments} optimizer state(s) of the shard"
    )
    note = (
        f"{_count(v)} / {ranks} ranks ({SHORT[master]}) + gathered whole ({SHORT[compute]}, FSDP root "
        f"group); {how}"
    )
    return Item("vision encoder", dtype, shard + gathered + trained, note), trained
