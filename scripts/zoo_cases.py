"""The model zoo's cases (scripts/bench_zoo.py): each a small configuration of a public model's own code,
installed from PyPI (transformers, diffusers, peft, timm, torchvision, x-transformers, vit-pytorch,
torch_geometric) or read at run time from a public repository checkout (nanoGPT, minGPT; ``--repos DIR``).
Nothing here is model code: each case only picks a constructor, its configuration, inputs and a loss.

A case's ``build(repos)`` imports its package and returns ``(factory, inputs, loss)`` as memest.estimate takes
them: ``factory()`` builds the model (memest calls it under fake tensors), ``inputs(batch[, seq])`` makes the
inputs, ``loss(output, inputs)`` the scalar (None: the output's ``.loss``, else the mean of its first tensor).
A missing package raises ImportError: the case is reported as skipped, not failed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Case:
    name: str
    family: str
    source: str  # the package or repository the model code comes from
    build: Callable[[Path | None], tuple[Any, Any, Any]]
    batch: int = 2
    seq: int | None = None
    optim: str = "adamw"
    precision: str = "fp32"
    note: str = ""  # what a user's own run would differ in (e.g. compiled by default: traced eagerly)
    options: dict = field(default_factory=dict)


def _cross_entropy(classes_dim: int = -1):
    def loss(out, _inputs):
        import torch
        import torch.nn.functional as F

        logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
        if logits is None:
            logits = out[0]
        target = torch.arange(logits.shape[0], device=logits.device) % logits.shape[classes_dim]
        return F.cross_entropy(logits, target)

    return loss


# -- transformers -------------------------------------------------------------------------------------------

DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)


def _hf_lm(model_type: str, auto: str = "AutoModelForCausalLM", **config):
    def build(_repos):
        import torch
        import transformers

        cfg = transformers.AutoConfig.for_model(model_type, **config)
        cls = getattr(transformers, auto)

        def inputs(batch, seq=32):
            ids = torch.randint(0, 200, (batch, seq))
            return {"input_ids": ids, "labels": ids.clone()}

        return (lambda: cls.from_config(cfg)), inputs, None

    return build


def _hf_encoder_mlm(model_type: str, **config):
    return _hf_lm(model_type, "AutoModelForMaskedLM", **config)


def _hf_seq2seq(model_type: str, **config):
    def build(_repos):
        import torch
        import transformers

        cfg = transformers.AutoConfig.for_model(model_type, **config)

        def inputs(batch, seq=32):
            ids = torch.randint(3, 200, (batch, seq))
            labels = torch.randint(3, 200, (batch, seq // 2))
            return {"input_ids": ids, "labels": labels}

        return (lambda: transformers.AutoModelForSeq2SeqLM.from_config(cfg)), inputs, None

    return build


def _hf_image(model_type: str, image: int = 32, **config):
    def build(_repos):
        import torch
        import transformers

        cfg = transformers.AutoConfig.for_model(model_type, num_labels=10, **config)

        def inputs(batch):
            return {"pixel_values": torch.randn(batch, 3, image, image),
                    "labels": torch.arange(batch) % 10}

        return (lambda: transformers.AutoModelForImageClassification.from_config(cfg)), inputs, None

    return build


def _whisper(_repos):
    import torch
    import transformers

    cfg = transformers.WhisperConfig(vocab_size=128, num_mel_bins=16, d_model=64, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                     decoder_ffn_dim=128, max_source_positions=64, max_target_positions=64,
                                     decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)

    def inputs(batch):  # input_features: 2 x max_source_positions frames, as the encoder requires
        return {"input_features": torch.randn(batch, 16, 128), "labels": torch.randint(3, 128, (batch, 24))}

    return (lambda: transformers.WhisperForConditionalGeneration(cfg)), inputs, None


def _wav2vec2(_repos):
    import torch
    import transformers

    cfg = transformers.Wav2Vec2Config(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128, conv_dim=[32, 32, 32], conv_stride=[5, 2, 2],
                                      conv_kernel=[10, 3, 3], num_conv_pos_embeddings=16,
                                      num_conv_pos_embedding_groups=4, layerdrop=0.0, mask_time_prob=0.0)

    def inputs(batch):  # the CTC head on its own: frame logits, a classification-style loss over frames
        return (torch.randn(batch, 4000),)

    def loss(out, _inputs):
        import torch.nn.functional as F

        logits = out.logits
        target = torch.arange(logits.shape[1], device=logits.device) % logits.shape[-1]
        return F.cross_entropy(logits.transpose(1, 2), target.expand(logits.shape[0], -1))

    return (lambda: transformers.Wav2Vec2ForCTC(cfg)), inputs, loss


def _clip(_repos):
    import torch
    import transformers

    cfg = transformers.CLIPConfig(
        projection_dim=32,
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=32),
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
    )

    def inputs(batch):
        return {"input_ids": torch.randint(3, 128, (batch, 16)), "pixel_values": torch.randn(batch, 3, 32, 32),
                "return_loss": True}

    return (lambda: transformers.CLIPModel(cfg)), inputs, None


# -- diffusers ------------------------------------------------------------------------------------------------

def _unet2d(_repos):
    import torch
    from diffusers import UNet2DModel

    def factory():
        return UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                           block_out_channels=(32, 64), norm_num_groups=8,
                           down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                           up_block_types=("AttnUpBlock2D", "UpBlock2D"))

    def inputs(batch):
        return (torch.randn(batch, 3, 16, 16), torch.tensor(10))

    def loss(out, inp):
        return ((out.sample - inp[0]) ** 2).mean()

    return factory, inputs, loss


def _unet2d_cond(_repos):
    import torch
    from diffusers import UNet2DConditionModel

    def factory():
        return UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
                                    block_out_channels=(32, 64), norm_num_groups=8, cross_attention_dim=32,
                                    attention_head_dim=8,
                                    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))

    def inputs(batch):
        return (torch.randn(batch, 4, 16, 16), torch.tensor(10), torch.randn(batch, 8, 32))

    def loss(out, inp):
        return ((out.sample - inp[0]) ** 2).mean()

    return factory, inputs, loss


def _vae(_repos):
    import torch
    from diffusers import AutoencoderKL

    def factory():
        return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 64),
                             layers_per_block=1, norm_num_groups=8,
                             down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                             up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"))

    def inputs(batch):
        return (torch.randn(batch, 3, 32, 32),)

    def loss(out, inp):
        return ((out.sample - inp[0]) ** 2).mean()

    return factory, inputs, loss


# -- peft -------------------------------------------------------------------------------------------------------

def _peft_lora(model_type: str, auto: str, targets: list[str], **config):
    def build(repos):
        import peft
        import transformers

        _, inputs, loss = _hf_lm(model_type, auto, **config)(repos)
        cfg = transformers.AutoConfig.for_model(model_type, **config)
        cls = getattr(transformers, auto)

        def factory():
            lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0)
            return peft.get_peft_model(cls.from_config(cfg), lora)

        return factory, inputs, loss

    return build


# -- x-transformers, vit-pytorch --------------------------------------------------------------------------------

def _xt_decoder(_repos):
    import torch
    from x_transformers import Decoder, TransformerWrapper

    def factory():
        return TransformerWrapper(num_tokens=256, max_seq_len=128,
                                  attn_layers=Decoder(dim=64, depth=2, heads=4))

    def inputs(batch, seq=32):
        return (torch.randint(0, 256, (batch, seq)),)

    def loss(out, inp):
        import torch.nn.functional as F

        return F.cross_entropy(out.transpose(1, 2), inp[0])

    return factory, inputs, loss


def _xt_encoder(_repos):
    import torch
    from x_transformers import Encoder, TransformerWrapper

    def factory():  # rotary positions, gated feed-forward, residual attention: its less plain options
        return TransformerWrapper(num_tokens=256, max_seq_len=128,
                                  attn_layers=Encoder(dim=64, depth=2, heads=4, rotary_pos_emb=True, ff_glu=True,
                                                      residual_attn=True))

    def inputs(batch, seq=32):
        return (torch.randint(0, 256, (batch, seq)),)

    def loss(out, inp):
        import torch.nn.functional as F

        return F.cross_entropy(out.transpose(1, 2), inp[0])

    return factory, inputs, loss


def _vit_pytorch(cls_name: str):
    def build(_repos):
        import torch
        import vit_pytorch

        cls = getattr(vit_pytorch, cls_name)
        kwargs = dict(image_size=32, patch_size=8, num_classes=10, dim=64, depth=2, heads=4, mlp_dim=128)

        def inputs(batch):
            return (torch.randn(batch, 3, 32, 32),)

        return (lambda: cls(**kwargs)), inputs, _cross_entropy()

    return build


# -- torch_geometric --------------------------------------------------------------------------------------------

def _pyg(cls_name: str, loops_in_data: bool = False):
    """``loops_in_data``: the graph already holds its self loops (torch_geometric.utils.add_self_loops in the
    data pipeline) and the layers do not insert them (add_self_loops=False): memest's way out of the
    data-dependent self-loop insertion."""

    def build(_repos):
        import torch
        import torch_geometric.nn as gnn
        from torch_geometric.utils import add_self_loops

        cls = getattr(gnn, cls_name)
        nodes, edges = 200, 800

        def factory():
            kwargs = {"heads": 2} if cls_name == "GAT" else {}
            if loops_in_data:
                kwargs["add_self_loops"] = False
            return cls(in_channels=16, hidden_channels=32, num_layers=2, out_channels=7, **kwargs)

        def inputs(batch):  # batch: graphs per step, one disjoint union (as torch_geometric's DataLoader batches)
            gen = torch.Generator().manual_seed(0)
            src = torch.randint(0, nodes, (batch * edges,), generator=gen)
            dst = (src + 1 + torch.randint(0, nodes - 1, (batch * edges,), generator=gen)) % nodes  # no self loops
            shift = torch.arange(batch).repeat_interleave(edges) * nodes
            edge_index = torch.stack([src + shift, dst + shift])
            if loops_in_data:
                edge_index, _ = add_self_loops(edge_index, num_nodes=batch * nodes)
            return (torch.randn(batch * nodes, 16), edge_index)

        def loss(out, _inputs):
            import torch.nn.functional as F

            return F.cross_entropy(out, torch.arange(out.shape[0], device=out.device) % out.shape[1])

        return factory, inputs, loss

    return build


# -- timm, torchvision ------------------------------------------------------------------------------------------

def _timm(name: str, image: int = 32, **kwargs):
    def build(_repos):
        import timm
        import torch

        def inputs(batch):
            return (torch.randn(batch, 3, image, image),)

        return (lambda: timm.create_model(name, pretrained=False, num_classes=10, **kwargs)), inputs, _cross_entropy()

    return build


def _torchvision(name: str, image: int = 32, **kwargs):
    def build(_repos):
        import torch
        import torchvision

        ctor = getattr(torchvision.models, name)

        def inputs(batch):
            return (torch.randn(batch, 3, image, image),)

        return (lambda: ctor(num_classes=10, **kwargs)), inputs, _cross_entropy()

    return build


def _tv_vit(_repos):
    import torch
    from torchvision.models.vision_transformer import VisionTransformer

    def inputs(batch):
        return (torch.randn(batch, 3, 32, 32),)

    return (lambda: VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64,
                                      mlp_dim=128, num_classes=10)), inputs, _cross_entropy()


# -- karpathy/nanoGPT, karpathy/minGPT (repository checkouts under --repos) ---------------------------------------

def _repo(repos: Path | None, name: str, marker: str) -> Path:
    if repos is None or not (repos / name / marker).is_file():
        raise ImportError(f"{name} checkout not found (pass --repos DIR holding {name}/{marker})")
    return repos / name


def _nanogpt(repos):
    import importlib.util

    import torch

    root = _repo(repos, "nanoGPT", "model.py")
    spec = importlib.util.spec_from_file_location("nanogpt_model", root / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.GPTConfig(block_size=128, vocab_size=256, n_layer=2, n_head=4, n_embd=64, dropout=0.0, bias=False)

    def inputs(batch, seq=64):  # train.py's get_batch: X, Y token blocks
        x = torch.randint(0, 256, (batch, seq))
        return (x, torch.roll(x, -1, 1))

    return (lambda: module.GPT(cfg)), inputs, (lambda out, _inp: out[1])  # logits, loss = model(X, Y)


def _mingpt(repos):
    import torch

    root = _repo(repos, "minGPT", "mingpt/model.py")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from mingpt.model import GPT

    cfg = GPT.get_default_config()  # its default dropouts (0.1) kept
    cfg.model_type = None
    cfg.n_layer, cfg.n_head, cfg.n_embd = 2, 4, 64
    cfg.vocab_size, cfg.block_size = 256, 128

    def inputs(batch, seq=64):  # trainer.py: logits, loss = model(x, y)
        x = torch.randint(0, 256, (batch, seq))
        return (x, torch.roll(x, -1, 1))

    return (lambda: GPT(cfg)), inputs, (lambda out, _inp: out[1])


# -- the zoo --------------------------------------------------------------------------------------------------

# cases that need memest's --data-dependent upper-bound (memest/trace/upper_bound.py), and why
UPPER_BOUND = {"data_dependent": "upper-bound"}
UPPER_BOUND_NOTE = (
    "traced with data_dependent=\"upper-bound\" (--data-dependent upper-bound): the layers' default self-loop "
    "insertion (add_remaining_self_loops / remove_self_loops: `edge_index[:, mask]`, boolean-mask indexing) has a "
    "value-dependent size, answered at its bound (every edge kept); these graphs hold no self loops, so the mask "
    "keeps every edge and the bound is attained (its complement, the loops' weights in GCN, is bounded at every "
    "edge too)"
)


def _c(name, family, source, build, **kw) -> Case:
    return Case(name=name, family=family, source=source, build=build, **kw)


CASES: list[Case] = [
    _c("nanogpt", "nanoGPT", "github:karpathy/nanoGPT", _nanogpt, seq=64,
       note="train.py compiles by default (compile=True): traced eagerly, as with compile=False"),
    _c("mingpt", "minGPT", "github:karpathy/minGPT", _mingpt, seq=64),
    # transformers decoders
    _c("hf-gpt2", "GPT-2", "transformers", _hf_lm("gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=256,
                                                   n_positions=128), seq=32),
    _c("hf-llama", "Llama", "transformers", _hf_lm("llama", **DECODER), seq=32),
    _c("hf-llama-bf16-mixed", "Llama", "transformers", _hf_lm("llama", **DECODER), seq=32, precision="bf16-mixed"),
    _c("hf-mistral", "Mistral", "transformers", _hf_lm("mistral", **DECODER), seq=32),
    _c("hf-qwen2", "Qwen2", "transformers", _hf_lm("qwen2", **DECODER), seq=32),
    _c("hf-qwen3", "Qwen3", "transformers", _hf_lm("qwen3", head_dim=16, **DECODER), seq=32),
    _c("hf-gemma", "Gemma", "transformers", _hf_lm("gemma", head_dim=16, **DECODER), seq=32),
    _c("hf-gemma2", "Gemma2", "transformers", _hf_lm("gemma2", head_dim=16, sliding_window=16, **DECODER), seq=32),
    _c("hf-phi", "Phi", "transformers", _hf_lm("phi", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                               num_attention_heads=4, vocab_size=256), seq=32),
    _c("hf-phi3", "Phi-3", "transformers", _hf_lm("phi3", pad_token_id=0, **DECODER), seq=32),
    _c("hf-falcon", "Falcon", "transformers", _hf_lm("falcon", hidden_size=64, num_hidden_layers=2,
                                                     num_attention_heads=4, vocab_size=256), seq=32),
    _c("hf-bloom", "BLOOM", "transformers", _hf_lm("bloom", hidden_size=64, n_layer=2, n_head=4, vocab_size=256),
       seq=32),
    _c("hf-opt", "OPT", "transformers", _hf_lm("opt", hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                               num_attention_heads=4, word_embed_proj_dim=64, vocab_size=256,
                                               max_position_embeddings=128), seq=32),
    _c("hf-gpt-neox", "GPT-NeoX", "transformers", _hf_lm("gpt_neox", hidden_size=64, intermediate_size=128,
                                                         num_hidden_layers=2, num_attention_heads=4, vocab_size=256),
       seq=32),
    _c("hf-stablelm", "StableLM", "transformers", _hf_lm("stablelm", **DECODER), seq=32),
    _c("hf-olmo2", "OLMo2", "transformers", _hf_lm("olmo2", **DECODER), seq=32),
    # mixture of experts
    _c("hf-mixtral", "Mixtral (MoE)", "transformers", _hf_lm("mixtral", num_local_experts=4, num_experts_per_tok=2,
                                                             **DECODER), seq=32),
    _c("hf-mixtral-bf16-mixed", "Mixtral (MoE)", "transformers",
       _hf_lm("mixtral", num_local_experts=4, num_experts_per_tok=2, **DECODER), seq=32, precision="bf16-mixed"),
    _c("hf-qwen2-moe", "Qwen2-MoE", "transformers",
       _hf_lm("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
              shared_expert_intermediate_size=64, **DECODER), seq=32),
    _c("hf-olmoe", "OLMoE", "transformers", _hf_lm("olmoe", num_experts=4, num_experts_per_tok=2, **DECODER), seq=32),
    # encoders, encoder-decoders
    _c("hf-bert", "BERT", "transformers", _hf_encoder_mlm("bert", hidden_size=64, intermediate_size=128,
                                                          num_hidden_layers=2, num_attention_heads=4, vocab_size=256),
       seq=32),
    _c("hf-roberta", "RoBERTa", "transformers", _hf_encoder_mlm("roberta", hidden_size=64, intermediate_size=128,
                                                                num_hidden_layers=2, num_attention_heads=4,
                                                                vocab_size=256), seq=32),
    _c("hf-deberta-v2", "DeBERTa-v2", "transformers",
       _hf_encoder_mlm("deberta-v2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       vocab_size=256), seq=32),
    _c("hf-distilbert", "DistilBERT", "transformers", _hf_encoder_mlm("distilbert", dim=64, hidden_dim=128, n_layers=2,
                                                                      n_heads=4, vocab_size=256), seq=32),
    _c("hf-electra", "ELECTRA", "transformers", _hf_encoder_mlm("electra", hidden_size=64, embedding_size=32,
                                                                intermediate_size=128, num_hidden_layers=2,
                                                                num_attention_heads=4, vocab_size=256), seq=32),
    _c("hf-t5", "T5", "transformers", _hf_seq2seq("t5", d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                                  vocab_size=256, decoder_start_token_id=0), seq=32),
    _c("hf-bart", "BART", "transformers", _hf_seq2seq("bart", d_model=64, encoder_layers=2, decoder_layers=2,
                                                      encoder_attention_heads=4, decoder_attention_heads=4,
                                                      encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=256,
                                                      max_position_embeddings=128), seq=32),
    # vision, speech, vision-text
    _c("hf-vit", "ViT", "transformers", _hf_image("vit", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                  num_attention_heads=4, image_size=32, patch_size=8)),
    _c("hf-swin", "Swin", "transformers", _hf_image("swin", image_size=32, patch_size=2, embed_dim=16,
                                                    depths=[1, 1], num_heads=[2, 4], window_size=4)),
    _c("hf-convnext", "ConvNeXt", "transformers", _hf_image("convnext", hidden_sizes=[16, 32], depths=[1, 1],
                                                            num_stages=2)),
    _c("hf-whisper", "Whisper (speech)", "transformers", _whisper),
    _c("hf-wav2vec2", "Wav2Vec2 (speech)", "transformers", _wav2vec2),
    _c("hf-clip", "CLIP (vision-text)", "transformers", _clip),
    # peft
    _c("peft-lora-llama", "peft LoRA", "peft", _peft_lora("llama", "AutoModelForCausalLM", ["q_proj", "v_proj"],
                                                          **DECODER), seq=32),
    _c("peft-lora-bert", "peft LoRA", "peft", _peft_lora("bert", "AutoModelForMaskedLM", ["query", "value"],
                                                         hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                         num_attention_heads=4, vocab_size=256), seq=32),
    # diffusers
    _c("diffusers-unet2d", "diffusers UNet", "diffusers", _unet2d),
    _c("diffusers-unet2d-cond", "diffusers UNet", "diffusers", _unet2d_cond),
    _c("diffusers-vae", "diffusers VAE", "diffusers", _vae),
    # x-transformers, vit-pytorch
    _c("x-transformers-decoder", "x-transformers", "x-transformers", _xt_decoder, seq=32),
    _c("x-transformers-encoder", "x-transformers", "x-transformers", _xt_encoder, seq=32),
    _c("vit-pytorch-vit", "vit-pytorch", "vit-pytorch", _vit_pytorch("ViT")),
    _c("vit-pytorch-simple", "vit-pytorch", "vit-pytorch", _vit_pytorch("SimpleViT")),
    # torch_geometric
    # the layers insert self loops by default: boolean-mask indexing, data-dependent; traced at its bound
    _c("pyg-gcn", "PyG", "torch_geometric", _pyg("GCN"), options=UPPER_BOUND, note=UPPER_BOUND_NOTE),
    _c("pyg-gat", "PyG", "torch_geometric", _pyg("GAT"), options=UPPER_BOUND, note=UPPER_BOUND_NOTE),
    _c("pyg-gcn-loops", "PyG", "torch_geometric", _pyg("GCN", loops_in_data=True),
       note="self loops in the data, add_self_loops=False (the way out memest's error names)"),
    _c("pyg-gat-loops", "PyG", "torch_geometric", _pyg("GAT", loops_in_data=True),
       note="self loops in the data, add_self_loops=False (the way out memest's error names)"),
    # timm
    _c("timm-resnet18", "timm", "timm", _timm("resnet18")),
    _c("timm-convnext-atto", "timm", "timm", _timm("convnext_atto")),
    _c("timm-vit-tiny", "timm", "timm", _timm("vit_tiny_patch16_224", image=32, img_size=32, patch_size=8,
                                             depth=2)),
    _c("timm-efficientnet-b0", "timm", "timm", _timm("efficientnet_b0")),
    _c("timm-mobilenetv3", "timm", "timm", _timm("mobilenetv3_small_100")),
    # torchvision
    _c("tv-resnet18", "torchvision", "torchvision", _torchvision("resnet18")),
    _c("tv-mobilenet-v3-small", "torchvision", "torchvision", _torchvision("mobilenet_v3_small")),
    _c("tv-efficientnet-b0", "torchvision", "torchvision", _torchvision("efficientnet_b0")),
    _c("tv-vit", "torchvision", "torchvision", _tv_vit),
]

PACKAGES = ["transformers", "diffusers", "peft", "timm", "torchvision", "x-transformers", "vit-pytorch",
            "torch_geometric", "accelerate"]
