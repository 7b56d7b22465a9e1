"""How accurate would a tensor-core CUDA backward be? A numpy model of its roundings.

bench/NOTES.md (j) plans the fast backward on bfloat16 tensor-core operands: the forward's
bf16 records (q e^G, k e^(G_C - G), w, u, A_qk), the states and state gradients as mma
operands (S, dS'), v_new and dv_new as operands, the per-chunk gradient products (T, dv_new,
dw, and the joint pass's d A_qk and d A_kk) and the pairwise A-side sums in the forward's
factorised form
(a reference point per 16-row block, q / k times e^(G - ref) or e^(ref - G) as operands).
This model runs the chunkwise backward of bench/model/chunk_backward.py in float64 with any
subset of those roundings (names in ROUNDINGS) and reports max |got - exact| / max |exact|
for each gradient of the transformed inputs (q, k, v, g, beta, h0), the measure
bench/device/bench_backward.py reports for fla (3.3e-3 .. 5.8e-3 on its training inputs)
and for the float32 kernels (2.1e-3 .. 3.0e-3, from bf16-rounded inputs). Two input sets:
the training form of bench_backward.py (precomputed gate logsigmoid(randn + 4)) and the
prefill form of bench_chunk.py (gate activation with lower bound -5). The last lines take
the kernels of 2026-12-04 with their bfloat16 outputs and add the next stores one by one
(bench/NOTES.md (aq)). Needs numpy only.

    python3 bench/model/backward_rounding.py [--T 512] [--heads 2]
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chunk_rounding import (BLOCK, CHUNK, bf16, blocked_inverse,  # noqa: E402
                            inputs as prefill_inputs, tf32)

# S_keys, dS_keys: the states and state gradients where the key gradients' products over V
# read them (dO S^T, dv_new S^T, v_new dS'^T and d Gamma_end's sum of dS' S) and nowhere
# else: the CUDA backward's bfloat16 states (cuda/backward_params.h, bench/NOTES.md (ao)).
# vn_store, dvn_store, dw_store: v_new, dv_new and dw as the scans and keys would store them
# for the later stages (keys and grads), the scans keeping their own in float32 registers;
# outputs: the gradients as the library returns them for bfloat16 inputs (dh0 stays float32),
# which the measured errors include (bench/NOTES.md (aq)).
PLAN = ["records", "S_op", "vn_op", "dS_op", "dvn_op", "wy_ops", "pair_ops", "S_keys",
        "dS_keys"]
# rec_qg .. rec_Aqk: one record each (`records` rounds all five).
RECORDS = ["rec_qg", "rec_kg", "rec_w", "rec_u", "rec_Aqk"]
# joint_ops: the operands of grads' first products alone (cuda/backward_chunk.cu,
# joint_products): dO and v_new for d A_qk, d(beta v) and v_new for d A_kk.
# keys_dout_dvn, keys_vn: the operands of the `keys` stage's products over V alone
# (cuda/backward_keys.cu, FLASHDELTA_BACKWARD_KEYS): dO and dv_new (its `mixed` form rounds
# these), v_new (its `bf16` form rounds all three); S and dS are S_keys, dS_keys.
# qk_store: q and k as the workspace keeps them after the L2 norm (qn, kn: read by records,
# keys and grads); tables_store: T and the A_kk products as records stores them for grads.
ROUNDINGS = PLAN + ["vn_store", "dvn_store", "dw_store", "outputs", "joint_ops",
                    "keys_dout_dvn", "keys_vn", "qk_store", "tables_store"] + RECORDS
GRADS = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]


def training_inputs(T, H, K, V, seed=0):
    """bench_backward.py's inputs: bf16 q, k, v, gate logsigmoid(randn + 4), beta sigmoid."""
    rng = np.random.default_rng(seed)
    q, k = bf16(rng.standard_normal((T, H, K))), bf16(rng.standard_normal((T, H, K)))
    v = bf16(rng.standard_normal((T, H, V)))
    g = bf16(-np.logaddexp(0, -(rng.standard_normal((T, H, K)) + 4)))
    beta = bf16(1 / (1 + np.exp(-rng.standard_normal((T, H)))))
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * K ** -0.5
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    return dict(q=q, k=k, v=v, g=g, beta=beta, h0=rng.standard_normal((H, K, V)) * 0.1)


def block_refs(G):
    """Per 16-row block, the midpoint of G over the block (as the forward's prepare kernel)."""
    C = G.shape[0]
    refs = np.empty_like(G)
    for i0 in range(0, C, BLOCK):
        refs[i0:i0 + BLOCK] = G[min(i0 + BLOCK // 2, C - 1)]
    return refs


def row_pairs(M, right, G, rnd):
    """sum_{j <= i} M[i, j] right[j] e^(G_i - G_j), factorised around row i's block
    reference; only columns up to the block's end take part (later ones are masked, and their
    factors e^(ref - G_j) could overflow), as in the forward's prepare kernel."""
    r = block_refs(G)
    out = np.zeros_like(right)
    for i0 in range(0, M.shape[0], BLOCK):
        blk, end, ref = slice(i0, i0 + BLOCK), i0 + BLOCK, r[i0]
        out[blk] = np.exp(G[blk] - ref) * (rnd("pair_ops", M[blk, :end]) @
                                           rnd("pair_ops", right[:end] * np.exp(ref - G[:end])))
    return out


def col_pairs(M, left, G, rnd):
    """sum_{i >= j} M[i, j] left[i] e^(G_i - G_j), factorised around column j's block
    reference; only rows from the block's start take part."""
    r = block_refs(G)
    out = np.zeros_like(left)
    for j0 in range(0, M.shape[1], BLOCK):
        blk, ref = slice(j0, j0 + BLOCK), r[j0]
        out[blk] = np.exp(ref - G[blk]) * (rnd("pair_ops", M[j0:, blk]).T @
                                           rnd("pair_ops", left[j0:] * np.exp(G[j0:] - ref)))
    return out


def backward(x, d_o, d_final, precision):
    """Gradients (dq, dk, dv, dg, dbeta, dh0) of <d_o, o> + <d_final, S_T> for every head,
    by the chunk algorithm with the named roundings applied."""
    def rnd(name, value):
        return precision[name](value) if name in precision else value

    T, H, K = x["q"].shape
    grads = {n: np.zeros_like(x[s]) for n, s in
             zip(GRADS, ["q", "k", "v", "g", "beta", "h0"])}
    for h in range(H):
        chunks, S = [], x["h0"][h].copy()
        for c0 in range(0, T, CHUNK):  # forward: records and the chunk-entry states
            rows = slice(c0, c0 + CHUNK)
            q, k = rnd("qk_store", x["q"][rows, h]), rnd("qk_store", x["k"][rows, h])
            v = x["v"][rows, h]
            b, G = x["beta"][rows, h], np.cumsum(x["g"][rows, h], axis=0)
            C, E, gC = q.shape[0], np.exp(G), G[-1]
            Aqk = np.tril((q * E) @ (k / E).T)
            Kd = np.tril((k * E) @ (k / E).T, -1)
            # "T_prod": T by the kernels' column blocks with that rounding of each product's
            # operands (chunk_rounding.blocked_inverse), else exact.
            Tm = (blocked_inverse(b[:, None] * Kd, precision["T_prod"]) if "T_prod" in precision
                  else np.linalg.inv(np.eye(C) + b[:, None] * Kd))
            kb, vb = b[:, None] * k * E, b[:, None] * v
            rec = {name: rnd("records", rnd("rec_" + name, value)) for name, value in
                   (("qg", q * E), ("kg", k * np.exp(gC - G)), ("w", Tm @ kb), ("u", Tm @ vb),
                    ("Aqk", Aqk))}
            vn = rec["u"] - rec["w"] @ rnd("S_op", S)
            chunks.append(dict(rows=rows, q=q, k=k, v=v, b=b, G=G, E=E, gC=gC, Kd=Kd, Tm=Tm,
                               kb=kb, vb=vb, S=S, vn=vn, **rec))
            S = np.exp(gC)[:, None] * S + rec["kg"].T @ rnd("vn_op", vn)
        dS = d_final[h].copy()
        for c in reversed(chunks):  # backward
            dO, S, vn = d_o[c["rows"], h], c["S"], c["vn"]
            Tm, Kd = rnd("tables_store", c["Tm"]), rnd("tables_store", c["Kd"])
            dS_op = rnd("dS_op", dS)
            dvn = c["Aqk"].T @ dO + c["kg"] @ dS_op
            dvn_op = rnd("dvn_op", dvn)
            dS_prev = c["qg"].T @ dO + np.exp(c["gC"])[:, None] * dS - c["w"].T @ dvn_op
            S_op, vn_op = rnd("S_op", S), rnd("vn_store", rnd("vn_op", vn))
            dvn = rnd("dvn_store", dvn)
            S_k, dS_k = rnd("S_keys", S_op), rnd("dS_keys", dS_op)
            kop = lambda m: rnd("keys_dout_dvn", m)  # noqa: E731
            dLq = kop(dO) @ S_k.T
            dAqk = np.tril(rnd("joint_ops", dO) @ rnd("joint_ops", vn_op).T)
            dkg = rnd("keys_vn", vn_op) @ dS_k.T
            dgC = np.exp(c["gC"]) * (rnd("dS_keys", dS) * rnd("S_keys", S)).sum(1) + \
                (dkg * c["kg"]).sum(0)
            dw = rnd("dw_store", -kop(rnd("dvn_store", dvn_op)) @ S_k.T)
            op = lambda m: rnd("wy_ops", m)  # noqa: E731
            jop = lambda m: rnd("joint_ops", op(m))  # noqa: E731
            dvb, dkb = op(Tm).T @ op(dvn), op(Tm).T @ op(dw)
            # d A_kk = -T^T dT T^T = -tril(d(beta v) v_new^T) (cuda/backward_chunk.cu: w and
            # u enter only v_new), in the joint pass beside d A_qk.
            dAkk = np.tril(-jop(dvb) @ jop(vn_op).T, -1)
            q, k, b, G, E = c["q"], c["k"], c["b"], c["G"], c["E"]
            dAkb = b[:, None] * dAkk
            p1, p2 = row_pairs(dAqk, k, G, rnd), row_pairs(dAkb, k, G, rnd)
            q1, q2 = col_pairs(dAqk, q, G, rnd), col_pairs(dAkb, k, G, rnd)
            kfac = np.exp(c["gC"] - G)
            dq = dLq * E + p1
            dk = dkg * kfac + b[:, None] * dkb * E + p2 + q1 + q2
            dG = dLq * q * E - dkg * k * kfac + dkb * c["kb"] + q * p1 + k * p2 - k * (q1 + q2)
            dG[-1] += dgC
            rows = c["rows"]
            grads["dq"][rows, h], grads["dk"][rows, h] = dq, dk
            grads["dv"][rows, h] = b[:, None] * dvb
            grads["dbeta"][rows, h] = (dvb * c["v"]).sum(1) + (dkb * k * E).sum(1) + \
                (dAkk * Kd).sum(1)
            grads["dg"][rows, h] = np.flip(np.cumsum(np.flip(dG, 0), 0), 0)
            dS = dS_prev
        grads["dh0"][h] = dS
    for n in GRADS[:-1]:
        grads[n] = rnd("outputs", grads[n])
    return grads


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, default=512)
    p.add_argument("--heads", type=int, default=2)
    a = p.parse_args()
    every = {name: bf16 for name in PLAN}
    for label, make in (("training inputs (bench_backward.py)", training_inputs),
                        ("prefill inputs (bench_chunk.py, lower bound -5)", prefill_inputs)):
        x = make(a.T, a.heads, 128, 128)
        rng = np.random.default_rng(1)
        d_o = bf16(rng.standard_normal(x["v"].shape))
        d_final = rng.standard_normal(x["h0"].shape)
        exact = backward(x, d_o, d_final, {})

        def errs(precision):
            got = backward(x, d_o, d_final, precision)
            return [np.abs(got[n] - exact[n]).max() / np.abs(exact[n]).max() for n in GRADS]

        def line(name, precision):
            print(f"  {name:34s} " + " ".join(f"{e:8.1e}" for e in errs(precision)))

        print(f"{label}, T={a.T}, {a.heads} heads, K=V=128: max |got - exact| / max |exact|")
        print(f"  {'':34s} " + " ".join(f"{n:>8s}" for n in GRADS))
        line("every bf16 rounding of the plan", every)
        for name in ROUNDINGS:
            if name not in RECORDS:
                line(f"only {name}", {name: bf16})
        line("pair_ops in tf32, the rest bf16", dict(every, pair_ops=tf32))
        line("records in tf32, the rest bf16", dict(every, records=tf32))
        line("records, vn_op, dS_op in tf32",
             dict(every, records=tf32, vn_op=tf32, dS_op=tf32, dS_keys=tf32))
        line("all in tf32", {name: tf32 for name in PLAN})
        today = dict({name: tf32 for name in PLAN}, S_keys=bf16, dS_keys=bf16)
        line("all in tf32, S and dS bf16 in keys", today)
        # The kernels of 2026-12-04 with their bfloat16 outputs (what bench_backward.py
        # measures), then the next stores of bench/NOTES.md (an)'s order one by one.
        line("today's kernels, outputs bf16", dict(today, outputs=bf16))
        # The forward's opt-in one-product inverse (bench/NOTES.md (at)), were the backward's
        # records to take it too.
        line("  + T in one tf32 product a step", dict(today, outputs=bf16, T_prod=tf32))
        for name in ("vn_store", "dvn_store", "dw_store"):
            line(f"  + {name} bf16", dict(today, outputs=bf16, **{name: bf16}))
        line("  + all three", dict(today, outputs=bf16, vn_store=bf16, dvn_store=bf16,
                                   dw_store=bf16))
        line("  + records bf16", dict(today, outputs=bf16, records=bf16))
        line("  + records, dw_store bf16", dict(today, outputs=bf16, records=bf16,
                                                dw_store=bf16))
        for name in RECORDS:
            line(f"  + {name} bf16", dict(today, outputs=bf16, **{name: bf16}))
        # grads' joint products on bfloat16 operands (FLASHDELTA_BACKWARD_JOINT, NOTES (ax)).
        line("  + joint_ops bf16", dict(today, outputs=bf16, joint_ops=bf16))
        # The keys stage on bfloat16 products (m16n8k16, FLASHDELTA_BACKWARD_KEYS): `mixed`
        # rounds dO and dv_new, `bf16` v_new too; first with float32 outputs (the forms'
        # own effect), then with the bfloat16 outputs bench_backward.py measures.
        f32_out = dict(today)
        mixed, full = dict(keys_dout_dvn=bf16), dict(keys_dout_dvn=bf16, keys_vn=bf16)
        line("  keys tf32, float32 outputs", f32_out)
        line("  keys mixed, float32 outputs", dict(f32_out, **mixed))
        line("  keys bf16, float32 outputs", dict(f32_out, **full))
        line("  + keys mixed", dict(today, outputs=bf16, **mixed))
        line("  + keys bf16", dict(today, outputs=bf16, **full))
        line("  + keys bf16, joint_ops bf16", dict(today, outputs=bf16, joint_ops=bf16, **full))
        # Halving the workspace's bytes (bench/NOTES.md (ba)): every intermediate stored in
        # bfloat16, the products as today (tf32, float32 sums), then on bfloat16 operands too.
        stores = dict(records=bf16, vn_store=bf16, dvn_store=bf16, dw_store=bf16,
                      qk_store=bf16, tables_store=bf16)
        line("  + qk_store bf16", dict(today, outputs=bf16, qk_store=bf16))
        line("  + tables_store bf16", dict(today, outputs=bf16, tables_store=bf16))
        line("  + every store bf16", dict(today, outputs=bf16, **stores))
        line("  + every store bf16 but dv_new", dict(today, outputs=bf16,
                                                    **dict(stores, dvn_store=tf32)))
        line("every store and operand bf16", dict(every, outputs=bf16, joint_ops=bf16,
                                                  **full, **stores))


if __name__ == "__main__":
    main()
