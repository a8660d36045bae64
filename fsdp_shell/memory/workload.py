"""A whole training configuration as one value, and what runs it: the model, its wrapping (ours
or PyTorch's FSDP1), a step's loss and the optimizer.

``Config`` names a model (an MLP of 6 residual 64-wide layers, fsdp-demo's ``TinyLM``, or a
tiny Hugging Face GPT-2 or Llama), FSDP's arguments, the optimizer, the backwards per step and
the world. ``model_of`` builds the model seeded, on the default device (under
``torch.device("meta")``: one with no memory, as a prediction takes it); ``wrap`` wraps a fresh
one on a gloo rank; ``loss_of`` is one forward of a training step, ``optimizer_of`` the
optimizer with torch's defaults but the learning rate. ``measure`` (``fsdp_shell.memory.measure``)
trains a configuration under ``LiveBytes``; ``fsdp_shell.predict.against`` predicts it.

The Hugging Face models (``hf_model``) are built from configurations in code with random
weights (nothing is downloaded) and need ``transformers`` (``pip install -e ".[hf]"``).
"""

from __future__ import annotations

import importlib
import itertools
import logging
from collections.abc import Iterable
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Literal, assert_never, get_args

import torch
from torch import nn

from fsdp_core import ShardingStrategy
from fsdp_shell.demo.model import Block, ModelConfig, TinyLM, lm_loss
from fsdp_shell.fsdp import FullyShardedDataParallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

__all__ = [
    "DEMO",
    "HF_VOCAB",
    "Config",
    "Impl",
    "Layer",
    "ModelName",
    "OptimizerName",
    "Prefetch",
    "hf_model",
    "loss_of",
    "model_of",
    "optimizer_of",
    "shard_per_block",
    "world_mesh",
    "wrap",
]

ModelName = Literal["mlp", "demo", "gpt2", "llama"]
OptimizerName = Literal["adamw", "adam", "sgd", "sgd_momentum"]
Prefetch = Literal["BACKWARD_PRE", "BACKWARD_POST", "none"]
Impl = Literal["ours", "fsdp1", "ours_fully_shard", "fsdp2"]
"""Which API: this library's ``FullyShardedDataParallel`` or PyTorch's FSDP1; this library's
``fully_shard`` or PyTorch's (FSDP2)."""

WIDTH = 64
"""The MLP's width (and its input's)."""
DEMO = ModelConfig(vocab=256, seq=32, width=64, heads=4, layers=3)
"""The ``demo`` model's shape."""
HF_VOCAB = 64
"""The Hugging Face models' vocabulary."""


@dataclass(frozen=True, slots=True)
class Config:
    """One training configuration; ``ValueError`` on a name nothing here knows."""

    strategy: str
    """A ``ShardingStrategy`` member's name (``"FULL_SHARD"``)."""
    _: KW_ONLY
    model: ModelName = "mlp"
    """``mlp`` (6 residual 64-wide layers), ``demo`` (fsdp-demo's ``TinyLM``), or a tiny Hugging
    Face ``gpt2`` or ``llama``."""
    orig: bool = False
    """``use_orig_params``."""
    bf16: bool = False
    """bf16 parameters, fp32 reduction."""
    accumulate: int = 1
    """Backwards per step; all but the last inside ``no_sync()``."""
    offload: bool = False
    """``CPUOffload(offload_params=True)``."""
    backward_prefetch: Prefetch = "BACKWARD_PRE"
    """A ``BackwardPrefetch`` member's name, or ``"none"`` for no backward prefetch."""
    forward_prefetch: bool = False
    optimizer: OptimizerName = "adamw"
    """torch's optimizer of that name with its defaults, lr aside (``optimizer_of``)."""
    hybrid_all_reduce: Literal["async", "sync"] = "async"
    """Ours' ``hybrid_all_reduce`` (FSDP1 has no such argument)."""
    ranks: int | None = None
    """The world's size; None: 4 for hybrid strategies (2 x 2), else 2."""
    reshard_after_forward: int | None = None
    """``fully_shard`` only: every call's ``reshard_after_forward``, an int for resharding to
    groups of that many ranks after forward (ZeRO++'s hpZ); None: as ``strategy`` says."""
    sync_every_micro: bool = False
    """With ``accumulate``: every backward reduces, the later ones accumulating into the reduced
    gradient the one before left (no ``no_sync()``)."""
    explicit_prefetch: bool = False
    """``fully_shard`` only: each block's forward prefetches the next block, its backward the
    one before (``set_modules_to_forward_prefetch``, ``set_modules_to_backward_prefetch``)."""

    def __post_init__(self) -> None:
        for field, allowed in (
            ("strategy", tuple(ShardingStrategy.__members__)),
            ("model", get_args(ModelName)),
            ("optimizer", get_args(OptimizerName)),
            ("backward_prefetch", get_args(Prefetch)),
            ("hybrid_all_reduce", ("async", "sync")),
        ):
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field}: expected one of {', '.join(allowed)}, got {getattr(self, field)!r}")
        if self.accumulate < 1 or (self.ranks is not None and self.ranks < 1):
            raise ValueError(f"accumulate and ranks: expected at least 1, got {self.accumulate} and {self.ranks}")

    @property
    def world(self) -> int:
        """The world's size."""
        if self.ranks is not None:
            return self.ranks
        return 4 if self.strategy.startswith("HYBRID") else 2

    @property
    def shard_size(self) -> int | None:
        """The shard group's size for a hybrid strategy (two ranks at most), else None."""
        return min(2, self.world) if self.strategy.startswith("HYBRID") else None


class Layer(nn.Module):
    """The MLP's block: a residual 64-wide linear layer and ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.relu(self.lin(x)) + x
        return out


def hf_model(kind: str) -> tuple[nn.Module, type[nn.Module]]:
    """A tiny Hugging Face model of ``kind`` with weights seeded by ``torch.manual_seed(0)``, and
    its block class: ``"gpt2"`` (tied embeddings; 2 layers 16 wide, 2 heads) or ``"llama"`` (GQA,
    RoPE buffers; 2 layers 16 wide, 4 heads over 2 key-value heads)."""
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"kind: expected gpt2 or llama, got {kind!r}")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if kind == "gpt2":
        gpt2 = importlib.import_module("transformers.models.gpt2.modeling_gpt2")
        torch.manual_seed(0)
        config = gpt2.GPT2Config(
            vocab_size=HF_VOCAB,
            n_positions=32,
            n_embd=16,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        model: nn.Module = gpt2.GPT2LMHeadModel(config)
        block: type[nn.Module] = gpt2.GPT2Block
        return model, block
    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    torch.manual_seed(0)
    config = llama.LlamaConfig(
        vocab_size=HF_VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = llama.LlamaForCausalLM(config)
    block = llama.LlamaDecoderLayer
    return model, block


def model_of(cfg: Config) -> tuple[nn.Module, type[nn.Module]]:
    """``cfg``'s model, seeded, on the default device, and its block class (the FSDP unit)."""
    torch.manual_seed(0)
    if cfg.model == "mlp":
        return nn.Sequential(*(Layer() for _ in range(6))), Layer
    if cfg.model == "demo":
        return TinyLM(DEMO), Block
    return hf_model(cfg.model)


def loss_of(model: nn.Module, cfg: Config, rank: int, step: int) -> torch.Tensor:
    """One forward of a training step: the batch of ``rank`` at ``step``, and the loss. Under
    ``FakeTensorMode`` the batch is fake (the generator is ignored there)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    if cfg.model == "mlp":
        out: torch.Tensor = model(torch.randn(8, WIDTH, generator=gen)).float().square().mean()
        return out
    if cfg.model == "demo":
        tokens = torch.randint(0, DEMO.vocab, (4, DEMO.seq + 1), generator=gen)
        return lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    ids = torch.randint(0, HF_VOCAB, (2, 16), generator=gen)
    loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
    return loss


def optimizer_of(cfg: Config, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """``cfg``'s optimizer, with torch's defaults but the learning rate (1e-3)."""
    match cfg.optimizer:
        case "adamw":
            return torch.optim.AdamW(params, lr=1e-3)
        case "adam":
            return torch.optim.Adam(params, lr=1e-3)
        case "sgd":
            return torch.optim.SGD(params, lr=1e-3)
        case "sgd_momentum":
            return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
        case _:
            assert_never(cfg.optimizer)


def world_mesh(cfg: Config) -> DeviceMesh:
    """The device mesh of ``cfg``'s world on the CPU: 1-D, or (replicate, shard) for a hybrid
    strategy. A host object whatever the device (its tensors are on the CPU), made before a
    measurement starts counting, as the script makes it before the model."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (cfg.world,) if cfg.shard_size is None else (cfg.world // cfg.shard_size, cfg.shard_size)
    names = ("shard",) if cfg.shard_size is None else ("replicate", "shard")
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def shard_per_block(impl: Impl, cfg: Config, mesh: DeviceMesh | None = None) -> nn.Module:
    """A fresh ``model_of(cfg)`` with ``fully_shard`` (ours or PyTorch's, by ``impl``) applied to
    every block and then the root, as FSDP2 scripts do, over ``mesh`` (None: ``world_mesh``'s):
    ``SHARD_GRAD_OP`` keeps parameters gathered after forward (``reshard_after_forward=False``),
    a hybrid strategy shards over a (replicate, shard) mesh, bf16 is
    ``MixedPrecisionPolicy(bf16, fp32)``, offload ``CPUOffloadPolicy`` (ours only: FSDP2 pins
    memory). ``ValueError`` for what FSDP2 has no form of (``NO_SHARD``, ``use_orig_params``,
    prefetch options)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_shell.fsdp2.api import fully_shard

    if cfg.strategy == "NO_SHARD" or cfg.orig or cfg.forward_prefetch or (cfg.offload and impl == "fsdp2"):
        raise ValueError(f"cfg: {impl} has no form of {cfg}")
    module, block = model_of(cfg)
    if mesh is None:
        mesh = world_mesh(cfg)
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.bf16
        else MixedPrecisionPolicy()
    )
    reshard: bool | int | None = False if cfg.strategy in ("SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2") else None
    if cfg.reshard_after_forward is not None:
        reshard = cfg.reshard_after_forward
    offload = CPUOffloadPolicy(pin_memory=False) if cfg.offload else OffloadPolicy()
    shard = fully_shard if impl == "ours_fully_shard" else torch_fully_shard
    blocks = [m for m in module.modules() if isinstance(m, block)]
    for m in blocks:
        shard(m, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, offload_policy=offload)
    shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, offload_policy=offload)
    if cfg.explicit_prefetch:
        for a, b in itertools.pairwise(blocks):
            a.set_modules_to_forward_prefetch([b])  # type: ignore[operator]  # FSDPModule's (both libraries')
            b.set_modules_to_backward_prefetch([a])  # type: ignore[operator]  # FSDPModule's (both libraries')
    return module


def wrap(impl: Impl, cfg: Config) -> FullyShardedDataParallel | TorchFSDP:
    """A fresh ``model_of(cfg)`` wrapped by ``impl`` on this gloo rank (a hybrid strategy: a
    (replicate, shard) mesh of the whole world), both given torch's own ``MixedPrecision`` and
    ``CPUOffload``. FSDP1 cannot offload without an accelerator."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if cfg.explicit_prefetch or cfg.reshard_after_forward is not None:
        raise ValueError(f"cfg: {impl} has no explicit_prefetch or reshard_after_forward (fully_shard's)")
    module, block = model_of(cfg)
    mesh = None
    if cfg.shard_size is not None:
        mesh = init_device_mesh(
            "cpu", (cfg.world // cfg.shard_size, cfg.shard_size), mesh_dim_names=("replicate", "shard")
        )
    precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.bf16 else None
    offload = CPUOffload(offload_params=cfg.offload)
    prefetch = None if cfg.backward_prefetch == "none" else cfg.backward_prefetch
    if impl == "ours":
        return FullyShardedDataParallel(
            module,
            auto_wrap_policy={block},
            sharding_strategy=ShardingStrategy[cfg.strategy],
            mixed_precision=precision,
            use_orig_params=cfg.orig,
            device_mesh=mesh,
            cpu_offload=offload,
            backward_prefetch=prefetch,
            forward_prefetch=cfg.forward_prefetch,
            hybrid_all_reduce=cfg.hybrid_all_reduce,
        )
    return TorchFSDP(
        module,
        auto_wrap_policy=ModuleWrapPolicy({block}),
        sharding_strategy=TorchStrategy[cfg.strategy.replace("HYBRID_SHARD_ZERO2", "_HYBRID_SHARD_ZERO2")],
        mixed_precision=precision,
        use_orig_params=cfg.orig,
        device_mesh=mesh,
        cpu_offload=offload,
        device_id=torch.device("cpu"),
        backward_prefetch=None if prefetch is None else BackwardPrefetch[prefetch],
        forward_prefetch=cfg.forward_prefetch,
    )
