"""Tiny random diffusers transformers, templates and requests (tests and ``sakura bench
adapters`` only).

Built the way diffusers' own model tests build theirs: the real classes with a few layers,
narrow heads and seeded random weights. Two sizes: ``"test"`` (unit tests, a 6x6 token grid)
and ``"bench"`` (wider, 4-6 blocks, a 32x32 grid = the token count of a 512x512 image) so
that masked-execution timings are not pure overhead. Never used as a product model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from sakura.dit.adapters.base import ModelAdapter
from sakura.dit.adapters.inputs import Conditioning, LatentImage, LatentRequest, LatentTemplate

KINDS = ("flux2", "sd3.5", "qwenimage", "qwenimage-2.1")


@dataclass(frozen=True)
class TinySpec:
    kind: str
    size: str
    grid: tuple[int, int]
    text_dim: int
    pooled_dim: int = 0


def _configs(kind: str, size: str) -> tuple[str, dict]:
    test = size == "test"
    if kind == "flux2":
        return "Flux2Transformer2DModel", dict(
            patch_size=1, in_channels=16 if test else 64, num_layers=2,
            num_single_layers=2 if test else 4, attention_head_dim=16 if test else 32,
            num_attention_heads=2 if test else 4, joint_attention_dim=32 if test else 64,
            timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4) if test else (8, 8, 8, 8),
            guidance_embeds=False)
    if kind == "sd3.5":
        return "SD3Transformer2DModel", dict(
            sample_size=12 if test else 64, patch_size=2, in_channels=4, num_layers=3 if test else 4,
            attention_head_dim=8 if test else 32, num_attention_heads=2 if test else 4,
            joint_attention_dim=32 if test else 64, caption_projection_dim=16 if test else 128,
            pooled_projection_dim=24 if test else 64, out_channels=4,
            pos_embed_max_size=16 if test else 32, dual_attention_layers=(0,) if test else (0, 1),
            qk_norm="rms_norm")
    if kind == "qwenimage":
        return "QwenImageTransformer2DModel", dict(
            patch_size=2, in_channels=16 if test else 64, out_channels=4 if test else 16,
            num_layers=2 if test else 4, attention_head_dim=16 if test else 32,
            num_attention_heads=2 if test else 4, joint_attention_dim=16 if test else 64,
            axes_dims_rope=(8, 4, 4) if test else (8, 12, 12))
    if kind == "qwenimage-2.1":
        return "QwenImage21Transformer2DModel", dict(
            in_channels=16 if test else 64, out_channels=16 if test else 64,
            num_layers=2 if test else 4, attention_head_dim=16 if test else 32,
            num_attention_heads=2 if test else 4, context_in_dim=32 if test else 64,
            axes_dims_rope=(4, 6, 6) if test else (8, 12, 12))
    raise ValueError(f"unknown tiny model kind {kind!r}; choose one of {KINDS}")


def tiny_spec(kind: str, size: str = "test") -> TinySpec:
    _, cfg = _configs(kind, size)
    grid = (6, 6) if size == "test" else (32, 32)
    text = cfg.get("joint_attention_dim", cfg.get("context_in_dim"))
    return TinySpec(kind, size, grid, int(text), int(cfg.get("pooled_projection_dim", 0)))


def tiny_transformer(kind: str, size: str = "test", seed: int = 0) -> torch.nn.Module:
    """A seeded random diffusers transformer of ``kind`` (weights ~ N(0, 1/fan_in))."""
    import diffusers

    cls, cfg = _configs(kind, size)
    torch.manual_seed(seed)
    model = getattr(diffusers, cls)(**cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / math.sqrt(p.shape[1])))
            elif p.ndim == 1 and p.numel() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (p.data if p.abs().sum() else 0))
    return model.eval()


def tiny_adapter(kind: str, size: str = "test", seed: int = 0) -> ModelAdapter:
    from sakura.dit.adapters.flux2 import Flux2Adapter  # lazy: diffusers
    from sakura.dit.adapters.qwenimage import QwenImageAdapter  # lazy: diffusers
    from sakura.dit.adapters.qwenimage21 import QwenImage21Adapter  # lazy: diffusers
    from sakura.dit.adapters.sd3 import SD3Adapter  # lazy: diffusers

    cls = {"flux2": Flux2Adapter, "sd3.5": SD3Adapter, "qwenimage": QwenImageAdapter,
           "qwenimage-2.1": QwenImage21Adapter}[kind]
    return cls(tiny_transformer(kind, size, seed), name=f"tiny-{kind}")


def box_mask(grid: tuple[int, int], ratio: float) -> torch.Tensor:
    """A centred box token mask ``[N]`` covering about ``ratio`` of the grid."""
    h, w = grid
    side_h = max(1, round(h * math.sqrt(ratio)))
    side_w = max(1, round((ratio * h * w) / side_h))
    a, b = (h - side_h) // 2, (w - min(side_w, w)) // 2
    m = torch.zeros(h, w, dtype=torch.bool)
    m[a:a + side_h, b:b + min(side_w, w)] = True
    return m.flatten()


def conditioning(spec: TinySpec, tokens: int, gen: torch.Generator,
                 image: tuple[int, int] | None = None) -> Conditioning:
    emb = torch.randn(1, tokens, spec.text_dim, generator=gen)
    pooled = torch.randn(1, spec.pooled_dim, generator=gen) if spec.pooled_dim else None
    if image is None:
        return Conditioning(emb, pooled)
    slots = torch.zeros(tokens, dtype=torch.bool)
    n = image[0] * image[1] // 4
    slots[1:1 + n] = True
    return Conditioning(emb, pooled, slots,
                        [LatentImage(torch.randn(image[0] * image[1], _channels(spec), generator=gen),
                                     image)])


def _channels(spec: TinySpec) -> int:
    _, cfg = _configs(spec.kind, spec.size)
    return int(cfg["in_channels"]) * (int(cfg["patch_size"]) ** 2 if spec.kind == "sd3.5" else 1)


def tiny_template(adapter: ModelAdapter, spec: TinySpec, ratio: float = 0.2, steps: int = 4,
                  seed: int = 1) -> LatentTemplate:
    gen = torch.Generator().manual_seed(seed)
    n = spec.grid[0] * spec.grid[1]
    lat = torch.randn(n, adapter.latent_channels, generator=gen)
    return LatentTemplate(lat, spec.grid, box_mask(spec.grid, ratio), conditioning(spec, 5, gen),
                          seed=seed, steps=steps, guidance=2.0)


def tiny_request(adapter: ModelAdapter, spec: TinySpec, seed: int = 7, refs: int = 0,
                 prefix_image: bool = False) -> LatentRequest:
    """An edit request; its prompt has another length than the template's (7 vs 5 tokens);
    ``refs`` FLUX.2 reference images, ``prefix_image`` a QwenImage 2.1 condition image."""
    gen = torch.Generator().manual_seed(seed)
    image = (4, 2) if prefix_image else None
    cond = conditioning(spec, 9 if prefix_image else 7, gen, image)
    uncond = conditioning(spec, 3, gen)
    references = [LatentImage(torch.randn(h * w, adapter.latent_channels, generator=gen), (h, w))
                  for h, w in [(3, 3), (2, 4), (4, 4)][:refs]]
    return LatentRequest(cond, uncond, seed, references)


# -- whole tiny pipelines on disk (a local "checkpoint" for build -> serve -> edit tests) ----

PIPELINE_KINDS = ("flux2", "sd3.5")


def tiny_vae(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny seeded VAE of ``family`` (``flux2``, ``sd3``, ``qwenimage``): 8x downsampling,
    4 latent channels."""
    import diffusers

    torch.manual_seed(seed)
    blocks = dict(down_block_types=("DownEncoderBlock2D",) * 4,
                  up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8),
                  layers_per_block=1, latent_channels=4, norm_num_groups=4)
    if family == "sd3":
        return diffusers.AutoencoderKL(**blocks, shift_factor=0.06, scaling_factor=1.5)
    if family == "flux2":
        vae = diffusers.AutoencoderKLFlux2(**blocks)
        vae.bn.running_mean.normal_(0, 0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
        return vae
    return diffusers.AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2],
                                            num_res_blocks=1, latents_mean=[0.1, -0.2, 0.3, 0.0],
                                            latents_std=[1.5, 0.5, 2.0, 1.0])


def _bpe_tokenizer(special: list[str]):
    """A tiny byte-level BPE trained on a few sentences (the real tokenizers' vocabularies
    cannot be downloaded here; the pipelines only need the tokenizer's interface)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["a photo of a person with a red hat and a blue shirt",
                             "user assistant system template prompt edit"], trainer)
    return tok


def _flux2_pipeline(seed: int):
    import diffusers
    from transformers import Qwen2TokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = Qwen2TokenizerFast(tokenizer_object=_bpe_tokenizer(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]), eos_token="<|im_end|>",
        pad_token="<|endoftext|>", bos_token=None, unk_token=None)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                         "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                         "assistant\n{% endif %}")
    torch.manual_seed(seed)
    # FLUX.2-klein stacks the text encoder's hidden states 9, 18 and 27: 28 narrow layers
    text = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=28,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024))
    _, cfg = _configs("flux2", "test")
    transformer = diffusers.Flux2Transformer2DModel(**{**cfg, "joint_attention_dim": 48})
    _seeded(transformer, seed)
    sched = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    return diffusers.Flux2KleinPipeline(scheduler=sched, vae=tiny_vae("flux2", seed),
                                        text_encoder=text, tokenizer=tok,
                                        transformer=transformer, is_distilled=False)


def _sd3_pipeline(seed: int):
    import diffusers
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizerFast

    def clip(hidden: int):
        tok = CLIPTokenizerFast(tokenizer_object=_bpe_tokenizer(
            ["<|startoftext|>", "<|endoftext|>"]), bos_token="<|startoftext|>",
            eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>",
            model_max_length=77)
        enc = CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=2, num_attention_heads=2, projection_dim=hidden,
            max_position_embeddings=77, eos_token_id=tok.eos_token_id,
            bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id))
        return tok, enc

    torch.manual_seed(seed)
    tok1, enc1 = clip(8)
    tok2, enc2 = clip(16)
    _, cfg = _configs("sd3.5", "test")
    # prompt embeddings: the two CLIPs' hidden states side by side, zero-padded to T5's width
    # (no T5 here: the pipeline pads with zeros), pooled: both projections
    transformer = diffusers.SD3Transformer2DModel(**{**cfg, "joint_attention_dim": 32,
                                                     "pooled_projection_dim": 24})
    _seeded(transformer, seed)
    sched = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    return diffusers.StableDiffusion3Pipeline(
        scheduler=sched, vae=tiny_vae("sd3", seed), text_encoder=enc1, tokenizer=tok1,
        text_encoder_2=enc2, tokenizer_2=tok2, text_encoder_3=None, tokenizer_3=None,
        transformer=transformer)


def _seeded(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / math.sqrt(p.shape[1])))
    model.eval()


def save_tiny_pipeline(kind: str, path, seed: int = 0):
    """Write a whole tiny seeded diffusers pipeline of ``kind`` (``flux2``: FLUX.2-klein with
    a Qwen3 text encoder; ``sd3.5``: SD3.5 with two CLIP encoders) to ``path`` with
    ``save_pretrained``: a local checkpoint folder that ``--model flux2`` / ``--model sd3``
    load like a real one (tests only). Returns ``path``."""
    makers = {"flux2": _flux2_pipeline, "sd3.5": _sd3_pipeline}
    if kind not in makers:
        raise ValueError(f"no tiny pipeline of kind {kind!r}; choose one of {PIPELINE_KINDS}")
    makers[kind](seed).save_pretrained(path)
    return path
