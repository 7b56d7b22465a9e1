"""Checks the deferred L2 norms of the CUDA chunk forward (src/cuda/chunk_prepare.cuh and
chunk_state.cuh, the record in cuda/chunk_params.h) in numpy float64.

The prepare kernel works on q and k as given and leaves their inverse lengths
n = 1 / sqrt(sum x^2 + 1e-6) to the places where a scale is exact:
    A_kk = diag(n_k) A_kk_raw diag(n_k)       (A_kk_raw[i, j] = beta_i k_i . k_j e^(G_i - G_j), j < i)
    A_qk = A_qk_raw diag(n_k)                 (A_qk_raw[i, j] = scale q_i . k_j e^(G_i - G_j), j <= i)
    T    = (I + A_kk)^-1,   w = (T diag(n_k)) (beta k e^G),   u = T (beta v)
    qg   = scale q e^G,     kg = k e^(G_C - G)                (raw, as written per key slice)
and the state kernel takes
    v_new = u - w S,   o = diag(n_q) (qg S + A_qk v_new),   S' = diag(e^G_C) S + kg^T diag(n_k) v_new.
This compares that, chunk by chunk with the kernel's padding (a partial last chunk filled with
zero tokens whose n is 0), against
1. the same chunk formulas on normalised q and k (DESIGN.md section 3), and
2. the token-by-token recurrence on normalised q and k (DESIGN.md section 1),
for KDA (vector gate, delta rule), Gated DeltaNet (scalar gate) and GLA (vector gate, linear
write), on raw q and k of very different lengths; and the split state scan (a segment's
affine map S_out = P S_in + e from the zero and unit states, then composed) on the deferred
records. Exact in exact arithmetic: the differences are float64 rounding (~1e-15).
Needs numpy only.

    python3 bench/model/deferred_norms.py
"""
import numpy as np

C = 64  # tokens per chunk
EPS = 1e-6
TOL = 1e-12


def inv_length(x):
    return 1.0 / np.sqrt((x * x).sum(-1) + EPS)


def inputs(rng, T, K, V, gate):
    # Raw q and k of lengths spread over four orders of magnitude.
    q = rng.standard_normal((T, K)) * np.exp(rng.uniform(-4, 4, (T, 1)))
    k = rng.standard_normal((T, K)) * np.exp(rng.uniform(-4, 4, (T, 1)))
    shape = (T, K) if gate == "vector" else (T, 1)
    g = -np.exp(rng.uniform(-5, 0.5, shape))  # log-space decay per step, up to ~-1.6
    return dict(q=q, k=k, v=rng.standard_normal((T, V)), g=g,
                beta=rng.uniform(0, 1, T), h0=rng.standard_normal((K, V)) * 0.1,
                scale=K ** -0.5)


def recurrent(x, delta):
    q = x["q"] * inv_length(x["q"])[:, None] * x["scale"]
    k = x["k"] * inv_length(x["k"])[:, None]
    S, o = x["h0"].copy(), np.empty(x["v"].shape)
    for t in range(q.shape[0]):
        S = np.exp(x["g"][t])[:, None] * S
        r = x["beta"][t] * (x["v"][t] - S.T @ k[t]) if delta else x["v"][t]
        S = S + np.outer(k[t], r)
        o[t] = S.T @ q[t]
    return o, S


def chunk_records(x, delta, deferred):
    """Per chunk, the record the state kernel reads: qg, kg, w, u, aqk, decay, n_q, n_k.
    deferred=False: the chunk formulas on normalised q, k (n_q = n_k = 1 in the record)."""
    T, K = x["q"].shape
    records = []
    for c0 in range(0, T, C):
        length = min(C, T - c0)

        def pad(a):  # the kernel's chunk: zero tokens past its last
            out = np.zeros((C,) + a.shape[1:])
            out[:length] = a[c0:c0 + length]
            return out

        q, k, v, b = pad(x["q"]), pad(x["k"]), pad(x["v"]), pad(x["beta"])
        G = np.cumsum(np.broadcast_to(pad(x["g"]), (C, K)), axis=0)
        nq, nk = np.zeros(C), np.zeros(C)
        nq[:length], nk[:length] = inv_length(q[:length]), inv_length(k[:length])
        if not deferred:
            q, k = q * nq[:, None], k * nk[:, None]
            nq[:length], nk[:length] = 1.0, 1.0
        # Pairwise decays e^(G_i - G_j) per key, summed over keys with the products.
        pair = np.exp(G[:, None, :] - G[None, :, :])
        akk = np.tril(np.einsum("ic,ijc,jc->ij", k, pair, k), -1) * b[:, None]
        aqk = np.tril(np.einsum("ic,ijc,jc->ij", q, pair, k)) * x["scale"]
        akk = nk[:, None] * akk * nk[None, :]
        aqk = aqk * nk[None, :]
        rec = dict(qg=x["scale"] * q * np.exp(G), kg=k * np.exp(G[-1] - G), aqk=aqk,
                   decay=np.exp(G[-1]), nq=nq, nk=nk)
        if delta:
            tm = np.linalg.inv(np.eye(C) + akk)
            rec["w"] = (tm * nk[None, :]) @ (b[:, None] * k * np.exp(G))
            rec["u"] = tm @ (b[:, None] * v)
        else:
            rec["w"], rec["u"] = np.zeros((C, K)), v
        records.append((rec, length))
    return records


def step(rec, S, with_u=True):
    """One chunk of the state kernel: (o rows, next S)."""
    vn = (rec["u"] if with_u else 0.0) - rec["w"] @ S
    o = rec["nq"][:, None] * (rec["qg"] @ S + rec["aqk"] @ vn)
    return o, rec["decay"][:, None] * S + rec["kg"].T @ (rec["nk"][:, None] * vn)


def scan(records, S):
    outs = []
    for rec, length in records:
        o, S = step(rec, S)
        outs.append(o[:length])
    return np.concatenate(outs), S


def split_scan(records, S, per):
    """The split scan: every segment's map from the zero state (e) and the unit states (P),
    then each segment's outputs from its entry state carried across the ones before."""
    K = S.shape[0]
    segments = [records[i:i + per] for i in range(0, len(records), per)]
    outs = []
    for seg in segments:
        e, P = np.zeros_like(S), np.eye(K)
        for rec, _ in seg:
            e = step(rec, e)[1]
            P = step(rec, P, with_u=False)[1]
        o, _ = scan(seg, S)
        outs.append(o)
        S = P @ S + e
    return np.concatenate(outs), S


def rel(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


def main():
    rng = np.random.default_rng(0)
    worst = 0.0
    print("deferred L2 norms against the normalised chunk formulas and the recurrence "
          "(max |diff| / max |ref|, o and final state)")
    for name, gate, delta in [("kda", "vector", True), ("gated_deltanet", "scalar", True),
                              ("gla", "vector", False)]:
        for T, K, V in [(200, 32, 16), (64, 16, 8), (150, 24, 40)]:
            x = inputs(rng, T, K, V, gate)
            o_rec, s_rec = recurrent(x, delta)
            o_ref, s_ref = scan(chunk_records(x, delta, deferred=False), x["h0"])
            deferred = chunk_records(x, delta, deferred=True)
            o_def, s_def = scan(deferred, x["h0"])
            o_split, s_split = split_scan(deferred, x["h0"], per=2)
            errs = dict(chunk_normalised=max(rel(o_def, o_ref), rel(s_def, s_ref)),
                        recurrence=max(rel(o_def, o_rec), rel(s_def, s_rec)),
                        split_scan=max(rel(o_split, o_def), rel(s_split, s_def)))
            worst = max(worst, *errs.values())
            print(f"  {name:15s} T={T:3d} K={K:2d} V={V:2d}  " +
                  "  ".join(f"{k} {e:.1e}" for k, e in errs.items()))
    print(f"max relative error {worst:.1e}")
    assert worst < TOL, f"deferred norms differ by {worst:.1e} (tolerance {TOL:.0e})"


if __name__ == "__main__":
    main()
