"""The chunkwise backward of KDA, written out: the blueprint for the CUDA backward (issue 6).

Per (sequence, head), K-first state S [K, V], natural-log decays g [T, K] (already
activated), beta [T], q already scaled and normalised. The forward over a chunk of C tokens
(Gamma = cumsum of g inside the chunk, E = exp(Gamma), gC = Gamma's last row):

    A_kk = tril(beta (k E)(k / E)^T, -1)      A_qk = tril((q E)(k / E)^T)
    T = (I + A_kk)^-1     w = T (beta k E)     u = T (beta v)
    v_new = u - w S       o = (q E) S + A_qk v_new
    S' = exp(gC) S + (k exp(gC - Gamma))^T v_new

The backward walks the chunks last to first with dS (the gradient of the state leaving the
chunk); each chunk needs only its entering state S, which the forward recomputes (one state
per chunk: the memory plan of issue 6). Every product below is a matrix product of the
chunk's tiles, the shape the CUDA kernels will take; `chunk_backward` is checked against
torch.autograd of the token-by-token recurrence (`python3 bench/model/chunk_backward.py`,
and tests/python/test_chunk_backward_model.py in CI). float64 throughout; exp(+-Gamma) is
formed directly, which is fine for this model (gates >= -5 per token, C = 64) but not for a
kernel (it factorises around reference points as the forward does).
"""
import torch

CHUNK = 64


def recurrent(q, k, v, g, beta, S0):
    """o [T, V] and the final state of the token-by-token recurrence (the definition)."""
    S, out = S0, []
    for t in range(q.shape[0]):
        S = torch.exp(g[t])[:, None] * S
        r = beta[t] * (v[t] - k[t] @ S)
        S = S + k[t][:, None] * r[None, :]
        out.append(q[t] @ S)
    return torch.stack(out), S


def chunk_tensors(q, k, v, g, beta, S):
    """The forward's intermediates of one chunk entering with state S."""
    C = q.shape[0]
    G = torch.cumsum(g, 0)
    E, Einv, gC = torch.exp(G), torch.exp(-G), G[-1]
    Lq, Lk, R = q * E, k * E, k * Einv
    Akk = torch.tril(beta[:, None] * (Lk @ R.T), -1)
    Aqk = torch.tril(Lq @ R.T)
    Tm = torch.linalg.inv(torch.eye(C, dtype=q.dtype) + Akk)
    kb, vb = beta[:, None] * Lk, beta[:, None] * v
    w, u = Tm @ kb, Tm @ vb
    vn = u - w @ S
    kg = k * torch.exp(gC - G)
    o = Lq @ S + Aqk @ vn
    S_next = torch.exp(gC)[:, None] * S + kg.T @ vn
    return dict(G=G, E=E, Einv=Einv, gC=gC, Lq=Lq, Lk=Lk, R=R, Aqk=Aqk, Tm=Tm, kb=kb, vb=vb,
                w=w, vn=vn, kg=kg, o=o, S_next=S_next)


def chunk_forward(q, k, v, g, beta, S0):
    """o and the state entering every chunk (what the backward recomputes and keeps)."""
    S, outs, states = S0, [], []
    for c0 in range(0, q.shape[0], CHUNK):
        s = slice(c0, c0 + CHUNK)
        states.append(S)
        x = chunk_tensors(q[s], k[s], v[s], g[s], beta[s], S)
        outs.append(x["o"])
        S = x["S_next"]
    return torch.cat(outs), S, states


def pair_dG(x, dAqk, dAkk_b):
    """The pairs' share of dG [C, K] (A_qk and A_kk back to Gamma through their factors
    Lq, Lk and R): row sums for the i side, column sums for the j side. dAkk_b = beta dA_kk."""
    dR = dAqk.T @ x["Lq"] + dAkk_b.T @ x["Lk"]
    return (dAqk @ x["R"]) * x["Lq"] + (dAkk_b @ x["R"]) * x["Lk"] - dR * x["R"]


def scalar_gate_pair_dG(x, dAqk, dAkk_b):
    """pair_dG summed over the channels: each pair's term is one number, M[i, j] =
    dA_qk A_qk + beta dA_kk A_kk' (A_kk' the products unscaled by beta), added to token i and
    taken from token j. The identity holds for any gate, but only a gate of one value per
    token needs no more than the sum: its gradient is the channels' sum
    (cuda/backward_chunk.cu, scalar_gate_pairs)."""
    M = dAqk * x["Aqk"] + dAkk_b * torch.tril(x["Lk"] @ x["R"].T, -1)
    return M.sum(1) - M.sum(0)


def chunk_backward(q, k, v, g, beta, S0, d_o, d_final):
    """Gradients (dq, dk, dv, dg, dbeta, dS0) of <d_o, o> + <d_final, S_final>."""
    _, _, states = chunk_forward(q, k, v, g, beta, S0)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dg, dbeta = torch.zeros_like(g), torch.zeros_like(beta)
    dS = d_final.clone()
    starts = list(range(0, q.shape[0], CHUNK))
    for c, c0 in reversed(list(enumerate(starts))):
        s = slice(c0, c0 + CHUNK)
        qc, kc, vc, bc, dO, S = q[s], k[s], v[s], beta[s], d_o[s], states[c]
        x = chunk_tensors(qc, kc, vc, g[s], bc, S)
        eC = torch.exp(x["gC"])
        # Outputs o and S' back to v_new, S and the record's tiles.
        dvn = x["Aqk"].T @ dO + x["kg"] @ dS
        dS_prev = x["Lq"].T @ dO + eC[:, None] * dS - x["w"].T @ dvn
        dLq = dO @ S.T                              # d(q E)
        dAqk = torch.tril(dO @ x["vn"].T)
        dkg = x["vn"] @ dS.T
        dgC = eC * (dS * S).sum(1) + (dkg * x["kg"]).sum(0)
        dw = -dvn @ S.T
        # The WY form: w = T kb, u = T vb, T = (I + A_kk)^-1. w and u enter only vn = u - w S,
        # so dT = dvn vb^T + dw kb^T = dvn (vb - kb S)^T = dvn ((I + A_kk) vn)^T, and
        # dA_kk = -T^T dT T^T = -T^T dvn vn^T: one product, as cuda/backward_chunk.cu takes it.
        dvb, dkb = x["Tm"].T @ dvn, x["Tm"].T @ dw
        dAkk = torch.tril(-dvb @ x["vn"].T, -1)
        # Back to q, k, v, beta and Gamma.
        dG = dLq * x["Lq"]
        dqc = dLq * x["E"]
        dkc = dkg * torch.exp(x["gC"] - x["G"])
        dG = dG - dkg * x["kg"]
        dvc = bc[:, None] * dvb
        dbc = (dvb * vc).sum(1) + (dkb * x["Lk"]).sum(1)
        dLk = bc[:, None] * dkb
        # A_qk = tril(Lq R^T), A_kk = tril(beta Lk R^T, -1).
        dLq2 = dAqk @ x["R"]
        dR = dAqk.T @ x["Lq"]
        dbc = dbc + (dAkk * (x["Lk"] @ x["R"].T)).sum(1)
        dAkk_b = bc[:, None] * dAkk
        dG = dG + dLk * x["Lk"] + pair_dG(x, dAqk, dAkk_b)  # dLk so far: T^T dw's share
        dLk = dLk + dAkk_b @ x["R"]
        dR = dR + dAkk_b.T @ x["Lk"]
        dqc = dqc + dLq2 * x["E"]
        dkc = dkc + dLk * x["E"] + dR * x["Einv"]
        dG[-1] += dgC
        # Gamma = cumsum(g): a reverse cumulative sum.
        dg[s] = torch.flip(torch.cumsum(torch.flip(dG, [0]), 0), [0])
        dq[s], dk[s], dv[s], dbeta[s] = dqc, dkc, dvc, dbc
        dS = dS_prev
    return dq, dk, dv, dg, dbeta, dS


def random_problem(T, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q = torch.nn.functional.normalize(rn(T, K), dim=-1) * K ** -0.5
    k = torch.nn.functional.normalize(rn(T, K), dim=-1)
    g = -5.0 * torch.sigmoid(rn(T, K))          # KDA's lower-bound form, in (-5, 0)
    beta = torch.sigmoid(rn(T))
    return q, k, rn(T, V), g, beta, rn(K, V) * 0.1, rn(T, V), rn(K, V)


def max_relative_errors(T=150, K=16, V=24, seed=0):
    """Per gradient: max |chunk - autograd| / max |autograd|."""
    q, k, v, g, beta, S0, d_o, d_final = random_problem(T, K, V, seed)
    inputs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, S0)]
    o, S = recurrent(*inputs)
    want = torch.autograd.grad((o * d_o).sum() + (S * d_final).sum(), inputs)
    got = chunk_backward(q, k, v, g, beta, S0, d_o, d_final)
    names = ["dq", "dk", "dv", "dg", "dbeta", "dS0"]
    return {n: ((a - b).abs().max() / b.abs().max()).item() for n, a, b in zip(names, got, want)}


if __name__ == "__main__":
    for T in (1, 64, 150):
        errs = max_relative_errors(T=T)
        print(f"T={T:4d}: " + "  ".join(f"{n} {e:.1e}" for n, e in errs.items()))
