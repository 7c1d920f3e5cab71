"""A Hugging Face Llama, built from a config (random weights, tied embeddings), trained as a pipeline.

    python -m pip install -e ".[hf]"
    python examples/hf_llama.py fit --config configs/hf_llama.yaml

The model is ``transformers.LlamaForCausalLM`` cut into pipeline blocks by hand: the token
embedding (which also computes the rotary position embedding), each decoder layer, and the
final norm with the output head, whose weight *is* the embedding's (``tie_word_embeddings``):
the first and last stage each hold a copy, kept equal by lightning_pipe. Tokens are bytes of
the Python standard library's source (vocabulary 256), so nothing is downloaded.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch import Tensor, nn
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_pipe import PipelineMixin

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt import StdlibText, adamw_warmup_cosine  # noqa: E402


class TokensIn(nn.Module):
    """Token embedding, plus the rotary (cos, sin) every decoder layer reads."""

    def __init__(self, embed: nn.Embedding, rotary: nn.Module) -> None:
        super().__init__()
        self.embed, self.rotary = embed, rotary

    def forward(self, ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        hidden = self.embed(ids)
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        cos, sin = self.rotary(hidden, positions)
        return hidden, cos, sin


class Layer(nn.Module):
    """One ``LlamaDecoderLayer``: (hidden, cos, sin) in and out; causal attention by SDPA."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.layer(hidden, attention_mask=None, position_embeddings=(cos, sin)), cos, sin


class TokensOut(nn.Module):
    """Final RMSNorm and the output head (tied to the token embedding)."""

    def __init__(self, norm: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, hidden: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return self.head(self.norm(hidden))


class HFLlama(PipelineMixin, L.LightningModule):
    """``LlamaForCausalLM`` from a config, its chain split over pipeline stages.

    Args:
        hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
            num_key_value_heads: the Llama config (vocabulary 256: bytes).
        block_size: context length.
        lr: peak AdamW learning rate (warm-up, then cosine decay over ``max_steps``).
    """

    def __init__(
        self,
        hidden_size: int = 128,
        intermediate_size: int = 344,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        block_size: int = 64,
        lr: float = 3e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        config = LlamaConfig(
            vocab_size=256,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            max_position_embeddings=block_size,
            tie_word_embeddings=True,
            attn_implementation="sdpa",
        )
        llama = LlamaForCausalLM(config)
        assert llama.lm_head.weight is llama.model.embed_tokens.weight, "the config ties the embeddings"
        self.tokens_in = TokensIn(llama.model.embed_tokens, llama.model.rotary_emb)
        self.layers = nn.ModuleList(Layer(layer) for layer in llama.model.layers)
        self.tokens_out = TokensOut(llama.model.norm, llama.lm_head)

    def pipeline_blocks(self) -> list[nn.Module]:
        return [self.tokens_in, *self.layers, self.tokens_out]

    def pipeline_loss(self, output: Tensor, batch: Any) -> Tensor:
        return F.cross_entropy(output.flatten(0, 1).float(), batch[1].flatten())

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.log("train_loss", self.pipeline_step(batch), prog_bar=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.pipeline_forward(batch, with_loss=True), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        return adamw_warmup_cosine(self)


def main(args: Optional[list[str]] = None) -> None:
    """LightningCLI entry point (``args`` in place of the command line): ``fit`` or ``validate`` with a config."""
    LightningCLI(HFLlama, StdlibText, save_config_kwargs={"overwrite": True}, args=args)


if __name__ == "__main__":
    main()
