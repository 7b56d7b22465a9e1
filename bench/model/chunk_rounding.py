"""Where the CUDA chunk forward's error comes from: a numpy model of its roundings.

The CUDA chunkwise forward (src/cuda/chunk_*) rounds several intermediates to bfloat16:
the state as an mma operand (S), v_new = u - w S, the record's w, u, q*2^G (qg),
k*2^(G_C - G) (kg) and A_qk, the factored operands of A_kk / A_qk (k or q times 2^(G - ref)
and k times 2^(ref - G), ref a per-channel point in each 16-row block), and the operands of
w = T (beta k 2^G) and u = T (beta v): T = (I + A_kk)^-1, beta k 2^G, beta v. This
model runs the same chunk algorithm in float64 with any subset of those roundings and
reports the relative Frobenius error of o against the token-by-token float64 recurrence,
on the inputs of bench/device/bench_chunk.py's first case (KDA, gate from A_log and
dt_bias with lower bound -5, q/k L2 norm, beta sigmoid, initial state 0.1 randn), so a
precision change can be sized before it is built. Needs numpy only; a second per case.

    python3 bench/model/chunk_rounding.py [--T 1024] [--heads 2]
"""
import argparse

import numpy as np

CHUNK, BLOCK = 64, 16
ROUNDINGS = ["S", "vnew", "w", "u", "qg", "kg", "Aqk", "Akk_op", "Aqk_op", "T_op", "kbeta_op",
             "vbeta_op"]


def round_mantissa(x, drop_bits):
    """Round-to-nearest-even to a float32 with the low `drop_bits` mantissa bits cleared."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    half = (1 << (drop_bits - 1)) - 1
    b = ((b + half + ((b >> drop_bits) & 1)) >> drop_bits) << drop_bits
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


def bf16(x):
    return round_mantissa(x, 16)


def tf32(x):
    return round_mantissa(x, 13)


def f16(x):
    """float16 (11-bit significand, subnormals below 2^-14; the kernels scale v_new's rows so
    their largest magnitude lies in [2^14, 2^15): no overflow, and this model's data stay
    in the normal range without that scale)."""
    return np.asarray(x, dtype=np.float16).astype(np.float64)


def split_bf16(x):
    """hi + lo bfloat16 pair (three mma products: hi*hi + hi*lo + lo*hi)."""
    hi = bf16(x)
    return hi + bf16(x - hi)


def inputs(T, H, K, V, seed=0):
    rng = np.random.default_rng(seed)
    q, k = bf16(rng.standard_normal((T, H, K))), bf16(rng.standard_normal((T, H, K)))
    v, graw = bf16(rng.standard_normal((T, H, V))), bf16(rng.standard_normal((T, H, K)))
    A_log = np.log(rng.random(H) * 15 + 1)
    dt_bias = rng.standard_normal((H, K)) * 0.5
    beta = 1 / (1 + np.exp(-bf16(rng.standard_normal((T, H)))))
    g = -5.0 / (1 + np.exp(-(np.exp(A_log)[None, :, None] * (graw + dt_bias[None]))))
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * K ** -0.5
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    return dict(q=q, k=k, v=v, g=g, beta=beta, h0=rng.standard_normal((H, K, V)) * 0.1)


def recurrent(x):
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    S, o = x["h0"].copy(), np.empty(v.shape)
    for t in range(q.shape[0]):
        S = S * np.exp(g[t])[:, :, None]
        r = beta[t][:, None] * (v[t] - np.einsum("hk,hkv->hv", k[t], S))
        S = S + k[t][:, :, None] * r[:, None, :]
        o[t] = np.einsum("hk,hkv->hv", q[t], S)
    return o


def blocked_inverse(A, op):
    """(I + A)^-1 for strictly lower A as the kernels take it (cuda/chunk_inverse.cuh): the
    diagonal 16 x 16 blocks exactly (float32 substitution), then by column blocks
    T_IJ = -T_II sum_M A_IM T_MJ with both operands of each product rounded by `op`."""
    C = A.shape[0]
    T = np.zeros((C, C))
    blocks = [slice(b, min(b + BLOCK, C)) for b in range(0, C, BLOCK)]
    for b in blocks:
        T[b, b] = np.linalg.inv(np.eye(b.stop - b.start) + A[b, b]).astype(np.float32)
    for J, bj in enumerate(blocks):
        for I in range(J + 1, len(blocks)):
            bi = blocks[I]
            X = sum(op(A[bi, blocks[M]]) @ op(T[blocks[M], bj]) for M in range(J, I))
            T[bi, bj] = (-(T[bi, bi] @ X)).astype(np.float32)
    return T


def chunked(x, precision):
    """The chunk algorithm; `precision` maps an intermediate's name (ROUNDINGS) to the
    rounding applied to it; absent names stay exact. "T_prod": T by blocked_inverse with its
    products' operands rounded so (else an exact inverse)."""
    def rnd(name, value):
        return precision[name](value) if name in precision else value

    T, H, _ = x["q"].shape
    o = np.empty(x["v"].shape)
    for h in range(H):
        S = x["h0"][h].copy()
        for c0 in range(0, T, CHUNK):
            rows = slice(c0, c0 + CHUNK)
            q, k, v = x["q"][rows, h], x["k"][rows, h], x["v"][rows, h]
            b, G = x["beta"][rows, h], np.cumsum(x["g"][rows, h], axis=0)
            C = q.shape[0]
            Akk, Aqk = np.zeros((C, C)), np.zeros((C, C))
            for i0 in range(0, C, BLOCK):
                blk, upto = slice(i0, min(i0 + BLOCK, C)), min(i0 + BLOCK, C)
                ref = G[min(i0 + BLOCK // 2, C - 1)]
                right = k[:upto] * np.exp(ref - G[:upto])
                Akk[blk, :upto] = rnd("Akk_op", k[blk] * np.exp(G[blk] - ref)) @ rnd("Akk_op", right).T
                # A_qk's row and column operands; "Aqk_row", "Aqk_col_off" (columns of the
                # blocks before) and "Aqk_col_diag" (the diagonal block's) override "Aqk_op",
                # and "Aqk_row_off" the row operand against the blocks before.
                part = lambda name, v: precision[name](v) if name in precision else rnd("Aqk_op", v)
                rows_exact = q[blk] * np.exp(G[blk] - ref)
                xr = part("Aqk_row", rows_exact)
                xr_off = precision["Aqk_row_off"](rows_exact) if "Aqk_row_off" in precision else xr
                Aqk[blk, :i0] = xr_off @ part("Aqk_col_off", right[:i0]).T
                Aqk[blk, i0:upto] = xr @ part("Aqk_col_diag", right[i0:upto]).T
            Akk, Aqk = np.tril(Akk, -1) * b[:, None], np.tril(Aqk)
            Tinv = (blocked_inverse(Akk, precision["T_prod"]) if "T_prod" in precision
                    else np.linalg.inv(np.eye(C) + Akk))
            T_op = rnd("T_op", Tinv)
            w = rnd("w", T_op @ rnd("kbeta_op", b[:, None] * k * np.exp(G)))
            if "fold_beta" in precision:  # u = (T diag(beta)) v: v is an exact bf16 operand
                u = rnd("u", rnd("T_op", Tinv * b[None, :]) @ v)
            else:
                u = rnd("u", T_op @ rnd("vbeta_op", b[:, None] * v))
            S_op = rnd("S", S)
            v_new = rnd("vnew", u - w @ S_op)
            Aqk_op = rnd("Aqk", Aqk)
            if "Aqk_diag" in precision:  # the diagonal 16 x 16 blocks stored so, the rest as "Aqk"
                diag = np.zeros_like(Aqk)
                for i0 in range(0, C, BLOCK):
                    diag[i0:i0 + BLOCK, i0:i0 + BLOCK] = 1
                Aqk_op = precision["Aqk_diag"](Aqk) * diag + Aqk_op * (1 - diag)
            o[rows, h] = rnd("qg", q * np.exp(G)) @ S_op + Aqk_op @ v_new
            S = np.exp(G[-1])[:, None] * S + rnd("kg", k * np.exp(G[-1] - G)).T @ v_new
    return o


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--gate-scale", type=float, default=1.0,
                   help="multiply the log gates (e.g. 0.05: weak gates, A_qk far from diagonal)")
    a = p.parse_args()
    x = inputs(a.T, a.heads, 128, 128)
    x["g"] = x["g"] * a.gate_scale
    ref = recurrent(x)

    def err(precision):
        o = chunked(x, precision)
        return np.linalg.norm(o - ref) / np.linalg.norm(ref)

    kernel = {name: bf16 for name in ROUNDINGS}
    def but(**changes):
        p = dict(kernel)
        for name, f in changes.items():
            if f is None:
                p.pop(name)
            else:
                p[name] = f
        return p

    print(f"KDA bench inputs, T={a.T}, {a.heads} heads, K=V=128, gates x{a.gate_scale}: "
          "relative error of o vs fp64")
    print(f"  {'chunk form, nothing rounded':40s} {err({}):.2e}")
    print(f"  {'every bfloat16 rounding of the kernel':40s} {err(kernel):.2e}")
    for name in ROUNDINGS:
        print(f"  only {name:8s} {err({name: bf16}):.2e}    all but {name:8s} {err(but(**{name: None})):.2e}")
    print("  what the kernel could change:")
    fold = dict(fold_beta=True, vbeta_op=None)
    print(f"  {'A_qk operands in tf32':44s} {err(but(Aqk_op=tf32)):.2e}")
    print(f"  {'A_qk operands as bf16 hi + lo':44s} {err(but(Aqk_op=split_bf16)):.2e}")
    print(f"  {'beta folded into T: u = (T diag beta) v':44s} {err(but(**fold)):.2e}")
    print(f"  {'both (tf32 A_qk operands, beta folded)':44s} {err(but(Aqk_op=tf32, **fold)):.2e}")
    print(f"  {'both, and A_qk stored in fp32':44s} {err(but(Aqk_op=tf32, Aqk=None, **fold)):.2e}")
    pair = dict(Aqk_op=split_bf16, Aqk=split_bf16)
    print(f"  {'A_qk and its operands as bf16 pairs (split)':44s} {err(but(**pair)):.2e}")
    print(f"  {'  column low parts on diagonal blocks only':44s} "
          f"{err(but(**pair, Aqk_col_off=bf16)):.2e}")
    print(f"  {'  row low parts only':44s} {err(but(**pair, Aqk_col_off=bf16, Aqk_col_diag=bf16)):.2e}")
    print(f"  {'  diagonal column low parts only':44s} {err(but(**pair, Aqk_row=bf16, Aqk_col_off=bf16)):.2e}")
    print(f"  {'  diagonal form, A_qk stored single':44s} "
          f"{err(but(Aqk_op=split_bf16, Aqk_col_off=bf16)):.2e}")
    diagonal = dict(Aqk_op=split_bf16, Aqk_row_off=bf16, Aqk_col_off=bf16)
    print(f"  {'  pairs on the diagonal tiles only':44s} {err(but(**diagonal, Aqk=split_bf16)):.2e}")
    print(f"  {'  ... and the A_qk pair on its diagonal blocks':44s} "
          f"{err(but(**diagonal, Aqk_diag=split_bf16)):.2e}")
    # The records as the kernels keep them by default for dense bfloat16 inputs
    # (ChunkParams::v_from_tokens): u = (T diag(beta)) v with v as given and u unrounded.
    given = dict(fold_beta=True, vbeta_op=None, u=None)
    print("  with v read as given (the default records for dense bfloat16 inputs):")
    print(f"  {'  A_qk single bfloat16 (default)':44s} {err(but(**given)):.2e}")
    print(f"  {'  A_qk and v_new in float16 (aqk_f16)':44s} "
          f"{err(but(**given, Aqk=f16, vnew=f16)):.2e}")
    print(f"  {'  the pair (split)':44s} {err(but(**given, **pair)):.2e}")
    print(f"  {'  the pair with v_new in float16':44s} {err(but(**given, **pair, vnew=f16)):.2e}")
    print(f"  {'  aqk_f16 and T diag(beta) in float16':44s} "
          f"{err(but(**given, Aqk=f16, vnew=f16, T_op=f16)):.2e}")
    print(f"  {'  ... and the pairs on the diagonal tiles':44s} "
          f"{err(but(**given, Aqk=f16, vnew=f16, T_op=f16, **diagonal)):.2e}")
    print(f"  {'T by column blocks, one tf32 product a step':44s} {err(but(T_prod=tf32)):.2e}")
    print(f"  {'T by column blocks, one bf16 product a step':44s} {err(but(T_prod=bf16)):.2e}")
    print(f"  {'only T_op, T in one tf32 product a step':44s} "
          f"{err({'T_op': bf16, 'T_prod': tf32}):.2e}")


if __name__ == "__main__":
    main()
