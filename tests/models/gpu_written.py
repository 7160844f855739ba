"""A model file written for a GPU, the ways people write it: the model moved and cast in build_model
(one factory per way: gpu_written.py:build_half ...), inputs and forward tensors made on device="cuda".
Embedding and output head share one weight (tied), which a move or cast must keep tied."""

import torch
from torch import nn

device = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB, DIM = 512, 128


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(64, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(DIM))

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device="cuda")  # a tensor made on the GPU in the forward
        h = self.embed(ids) + self.pos(positions)
        h = h + self.mlp(self.norm(h)) * self.scale
        return self.head(h)


def build_model():  # the is_available() pattern (the CLI hides CUDA: this takes the CPU branch)
    return TinyLM().to(device)


def build_cuda():
    return TinyLM().cuda()


def build_to_cuda_index():
    return TinyLM().to("cuda:0")


def build_device_object():
    model = TinyLM()
    model.to(torch.device("cuda"))  # in place, result unused
    return model


def build_half():
    return TinyLM().cuda().half()


def build_bf16():
    return TinyLM().to(torch.bfloat16)


def build_device_and_dtype():
    return TinyLM().to(device="cuda", dtype=torch.bfloat16)


def build_round_trip():
    return TinyLM().half().float().cuda()


def build_on_device():  # parameters created on the GPU by their constructors
    with torch.device("cuda"):
        return TinyLM()


def example_inputs(batch_size, seq_len=32):
    return (torch.randint(0, VOCAB, (batch_size, seq_len), device="cuda"),)


def compute_loss(logits, inputs):
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), inputs[0].flatten())
