"""torchtune's CEWithChunkedOutputLoss, copied for the ground-truth step (torchtune cannot be imported beside
this environment's torchao: torchtune/__init__ imports torchao.dtypes.nf4tensor).

Source: https://github.com/pytorch/torchtune/blob/bd2a0fc7c31430972728494fa01aaeeb0ebf1ba1/torchtune/modules/loss/ce_chunked_output_loss.py
(Copyright (c) Meta Platforms, Inc. and affiliates; BSD-style license). Copied verbatim except: the
``@deprecated`` decorator, the ``SFTLoss`` base, the DTensor branch (single-process here) and the compile helpers
are left out; ``forward`` and ``compute_cross_entropy`` are the library's lines.
"""

import torch
import torch.nn.functional as F


class CEWithChunkedOutputLoss(torch.nn.Module):
    def __init__(self, num_output_chunks: int = 8, ignore_index: int = -100):
        super().__init__()
        self.num_output_chunks = num_output_chunks
        self.ignore_index = ignore_index

    def compute_cross_entropy(
        self, logits: torch.Tensor, labels: torch.Tensor, normalize: bool = True
    ) -> torch.Tensor:
        """
        Upcast logits to fp32 and compute cross entropy loss.
        """
        return F.cross_entropy(
            logits.float(), labels, ignore_index=self.ignore_index, reduction="sum"
        )

    def forward(self, logits: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        total_elements = (labels != self.ignore_index).sum()

        # chunk and reshape labels (bsz, num_tokens, vocab) -> [(bsz*num_tokens/num_chunks, vocab)]
        labels = [
            target_chunk.reshape(-1)
            for target_chunk in labels.tensor_split(self.num_output_chunks, dim=1)
        ]

        # reshape logits [(bsz, num_tokens/num_chunks, vocab)] -> [(bsz*num_tokens/num_chunks, vocab)]
        logits = [
            logit_chunk.reshape(-1, logit_chunk.size(-1)) for logit_chunk in logits
        ]

        # compute one chunk at a time
        total_loss = 0.0
        for logits_chunk, labels_chunk in zip(logits, labels):  # noqa: B905 (torchtune's line)
            total_loss += self.compute_cross_entropy(logits_chunk, labels_chunk)

        return total_loss / total_elements
