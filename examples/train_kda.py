"""Train a small language model with KDA layers on the GPU, once with FlashDelta's chunk_kda
and once with fla's, from the same seed on the same data, and print both losses side by side.

Model: byte embedding (vocab 256) -> 2 blocks of [RMSNorm -> KDA -> residual, RMSNorm -> MLP ->
residual] -> RMSNorm -> head (tied to the embedding). The KDA layer (hidden 256, 2 heads of
K = V = 128) projects q, k, v, a per-key-channel log gate g = -softplus(linear(x))
[B, T, H, K] and beta = sigmoid(linear(x)) [B, T, H], and calls chunk_kda(q, k, v, g, beta,
use_qk_l2norm_in_kernel=True): the same call for both libraries.

Task: next-byte prediction on sequences of 512 bytes, each drawn uniformly from its own
random alphabet of 4 bytes. Every byte is equally likely a priori, so the loss falls below
what the current byte alone allows (4.72) only through the KDA layers' memory of the bytes
seen so far (uniform: ln 256 = 5.55; the best possible: ln 4 = 1.39). On the CPU (checked
while writing it) 100 steps went from 5.50 to 4.24; on an H200 beside fla the losses agreed
within 1e-3 at every printed step (5.5022 to 4.2378, fla 4.2383), 13.27 ms per step against
fla's 18.11 (bench/results/train-kda-2026-12-01-beside-fla.txt). (A copy
task, second half = first half, stays at ln 256 for 100 steps: too hard for this model
without positions.) Batch 8, bf16 autocast over fp32 parameters, AdamW (lr 1e-3), gradients
clipped at norm 1.

The two runs advance in lockstep (one step of each, in turn), so the losses print as they
come; the losses agree closely at first and drift apart slowly (different kernels round
differently). At the end: milliseconds per training step of each (median, first steps
excluded: fla autotunes its kernels on its first call).

    python3 examples/train_kda.py                       # both, 100 steps
    python3 examples/train_kda.py --impl flashdelta --steps 300

Needs a CUDA GPU; without one it says so and exits 0. fla (pip install fla-core) is optional:
without it only FlashDelta runs. Exit status 1 when FlashDelta fails (an fla failure is
printed, and does not count).
"""

import argparse
import math
import statistics
import sys
import time

VOCAB, HIDDEN, HEADS, HEAD_K, HEAD_V, LAYERS = 256, 256, 2, 128, 128, 2
ALPHABET = 4  # bytes per sequence
WARMUP_STEPS = 3  # not timed: the first calls compile / autotune


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--impl", choices=("both", "flashdelta", "fla"), default="both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    return p.parse_args(argv)


def chunk_kda_of(impl):
    """The chunk_kda function of impl (ImportError when it is not installed)."""
    if impl == "flashdelta":
        import flashdelta
        return flashdelta.chunk_kda
    from fla.ops.kda import chunk_kda
    return chunk_kda


def build_model(torch, chunk_kda):
    nn, F = torch.nn, torch.nn.functional

    class RMSNorm(nn.Module):
        def __init__(self, dim, eps=1e-6):
            super().__init__()
            self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    class KDA(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(HIDDEN, HEADS * HEAD_K, bias=False)
            self.k = nn.Linear(HIDDEN, HEADS * HEAD_K, bias=False)
            self.v = nn.Linear(HIDDEN, HEADS * HEAD_V, bias=False)
            self.g = nn.Linear(HIDDEN, HEADS * HEAD_K)
            self.b = nn.Linear(HIDDEN, HEADS)
            self.o = nn.Linear(HEADS * HEAD_V, HIDDEN, bias=False)
            # Gate biases spread over time scales from ~3 to ~400 tokens (softplus(-1) ~ 0.31,
            # softplus(-6) ~ 0.0025 per token), so some channels can remember half a sequence.
            with torch.no_grad():
                self.g.bias.uniform_(-6.0, -1.0)

        def forward(self, x):
            B, T, _ = x.shape
            bf = torch.bfloat16  # the kernels take bf16 inputs (autocast leaves some in fp32)
            q = self.q(x).view(B, T, HEADS, HEAD_K).to(bf)
            k = self.k(x).view(B, T, HEADS, HEAD_K).to(bf)
            v = self.v(x).view(B, T, HEADS, HEAD_V).to(bf)
            g = (-F.softplus(self.g(x).float())).view(B, T, HEADS, HEAD_K).to(bf)  # log decay
            beta = torch.sigmoid(self.b(x).float()).to(bf)                          # [B, T, H]
            o, _ = chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
            return self.o(o.reshape(B, T, HEADS * HEAD_V))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.attn = RMSNorm(HIDDEN), KDA()
            self.norm2 = RMSNorm(HIDDEN)
            self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(),
                                     nn.Linear(4 * HIDDEN, HIDDEN))

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.norm, self.head = RMSNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)
            # Tied, small embedding: a byte's logit starts out tracking how much of it the
            # layers read from memory, which makes the task learnable in ~100 steps.
            self.head.weight = self.embed.weight
            nn.init.normal_(self.embed.weight, std=0.02)

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    return Model()


def make_batches(torch, steps, batch, seq_len, seed):
    """(inputs, targets) per step, on the GPU: seq_len + 1 bytes per sequence drawn from its
    own random ALPHABET bytes; inputs = the first seq_len, targets = the last seq_len."""
    gen = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(steps):
        alphabets = torch.rand(batch, VOCAB, generator=gen).argsort(dim=1)[:, :ALPHABET]
        picks = torch.randint(0, ALPHABET, (batch, seq_len + 1), generator=gen)
        seq = alphabets.gather(1, picks)
        out.append((seq[:, :-1].contiguous().cuda(), seq[:, 1:].contiguous().cuda()))
    return out


def loss_levels():
    """Cross-entropy of: uniform guessing; the best guess from the current byte alone (it is
    in the alphabet: probability 1/ALPHABET on it, the rest spread over the other bytes); the
    best guess knowing the alphabet."""
    a = 1 / ALPHABET
    alone = -a * math.log(a) - (1 - a) * math.log((1 - a) / (VOCAB - 1))
    return math.log(VOCAB), alone, math.log(ALPHABET)


class Run:
    """One implementation's model, optimizer, losses and step times."""

    def __init__(self, torch, impl, args):
        self.torch, self.impl = torch, impl
        torch.manual_seed(args.seed)  # the same initial weights for every implementation
        self.model = build_model(torch, chunk_kda_of(impl)).cuda()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        self.losses, self.times, self.error = {}, [], None

    def step(self, i, inputs, targets):
        torch = self.torch
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = self.model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB),
                                                 targets.reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.losses[i] = loss.item()  # synchronises: the step's time is complete
        self.times.append(time.perf_counter() - t0)


def main(argv=None):
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("train_kda.py: needs torch with a CUDA GPU (torch is not installed); nothing to do")
        return 0
    if not torch.cuda.is_available():
        print("train_kda.py: needs a CUDA GPU (torch.cuda.is_available() is False); "
              "nothing to do")
        return 0

    impls = ["flashdelta", "fla"] if args.impl == "both" else [args.impl]
    runs = []
    for impl in impls:
        try:
            runs.append(Run(torch, impl, args))
        except ImportError as e:
            if impl == "fla" and args.impl == "both":
                print(f"note: fla is not importable ({e}); training with FlashDelta alone")
                continue
            print(f"train_kda.py: {impl} is not importable: {e}")
            return 1
    batches = make_batches(torch, args.steps, args.batch, args.seq_len, args.seed)
    print(f"{torch.cuda.get_device_name(0)}; B={args.batch} T={args.seq_len} hidden={HIDDEN} "
          f"H={HEADS} K=V={HEAD_K}, {LAYERS} KDA blocks; "
          f"{sum(p.numel() for p in runs[0].model.parameters()) / 1e6:.2f} M parameters")
    print("loss levels: uniform %.2f, from the current byte alone %.2f, best %.2f"
          % loss_levels())
    print(f"{'step':>6}" + "".join(f"{'loss ' + r.impl:>18}" for r in runs), flush=True)

    for i, (inputs, targets) in enumerate(batches, start=1):
        for run in runs:
            if run.error is None:
                try:
                    run.step(i, inputs, targets)
                except Exception as e:  # noqa: BLE001 (one failing library leaves the other)
                    run.error = f"{type(e).__name__}: {e}"
                    print(f"!! {run.impl} failed at step {i}: {run.error}", flush=True)
        if i == 1 or i % 10 == 0 or i == args.steps:
            print(f"{i:>6}" + "".join(f"{r.losses[i]:>18.4f}" if i in r.losses else f"{'-':>18}"
                                      for r in runs), flush=True)

    print()
    for run in runs:
        timed = run.times[WARMUP_STEPS:]
        if timed:
            print(f"{run.impl:>10}: {statistics.median(timed) * 1e3:8.2f} ms per step (median "
                  f"of {len(timed)}; first step {run.times[0]:.1f} s)")
        elif run.error is None:
            print(f"{run.impl:>10}: too few steps to time (the first {WARMUP_STEPS} are not)")
        if run.error is not None:
            print(f"{run.impl:>10}: FAILED: {run.error}")
    return 1 if any(r.error is not None for r in runs if r.impl == "flashdelta") else 0


if __name__ == "__main__":
    sys.exit(main())
