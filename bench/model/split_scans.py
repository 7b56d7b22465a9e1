"""Checks the algebra of the split scans (cuda/backward_scans_mma.cu and cuda/chunk_state.cuh,
DESIGN.md section 3) in numpy float64, with the kernels' per-chunk formulas on random
operands:
  states,  chunks in order:   v_new = u - w S            S <- diag(decay) S + kg^T v_new
  dstates, chunks reversed:   dv_new = A_qk^T dO + kg dS'  dS <- diag(decay) dS' + qg^T dO - w^T dv_new
1. A segment moves every state column by one affine map: run from the identity with u = 0
   it gives P, from zero it gives e, and S_out = P S_in + e.
2. The split algorithm (every segment's map, then each segment from its entry carried across
   the segments before it) gives the unsplit scans' states, v_new, dS' and dv_new.
3. The gradient's map over a segment (from the identity with dO = 0, chunks reversed) is the
   transpose of the states' P (branch next/shared-transition reads it so).
Needs numpy only.

    python3 bench/model/split_scans.py
"""
import numpy as np

K, V, C = 12, 7, 5  # keys, values, tokens per chunk (small: the algebra, not the sizes)


def random_chunks(rng, n):
    chunks = []
    for _ in range(n):
        a = np.tril(rng.normal(size=(C, C)))
        chunks.append(dict(w=rng.normal(size=(C, K)) * 0.3, kg=rng.normal(size=(C, K)) * 0.3,
                           u=rng.normal(size=(C, V)), decay=rng.uniform(0.5, 1.0, size=K),
                           qg=rng.normal(size=(C, K)) * 0.3, aqk=a, dout=rng.normal(size=(C, V))))
    return chunks


def states(chunks, s, zero_u=False):
    """The state entering each chunk, each chunk's v_new, and the state leaving the last."""
    entering, vns = [], []
    for ch in chunks:
        entering.append(s)
        vn = (0.0 if zero_u else ch["u"]) - ch["w"] @ s
        vns.append(vn)
        s = ch["decay"][:, None] * s + ch["kg"].T @ vn
    return entering, vns, s


def dstates(chunks, ds, zero_dout=False):
    """dS' (the gradient of the state leaving each chunk), dv_new per chunk, and the
    gradient of the state entering the first chunk; chunks taken last to first."""
    leaving, dvs = [None] * len(chunks), [None] * len(chunks)
    for c in reversed(range(len(chunks))):
        ch = chunks[c]
        dout = np.zeros((C, ds.shape[1])) if zero_dout else ch["dout"]
        leaving[c] = ds
        dv = ch["aqk"].T @ dout + ch["kg"] @ ds
        dvs[c] = dv
        ds = ch["decay"][:, None] * ds + ch["qg"].T @ dout - ch["w"].T @ dv
    return leaving, dvs, ds


def check(name, got, want, tol=1e-10):
    err = max(np.max(np.abs(g - w)) for g, w in zip(got, want))
    assert err < tol, f"{name}: {err:.3e}"
    print(f"{name}: max |difference| {err:.1e}")


def main():
    rng = np.random.default_rng(7)
    n, per = 23, 5  # 23 chunks in segments of 5: the last one short
    chunks = random_chunks(rng, n)
    segments = [chunks[i:i + per] for i in range(0, n, per)]
    s0, dfinal = rng.normal(size=(K, V)), rng.normal(size=(K, V))

    # 1. One segment's affine map.
    seg = segments[1]
    p = states(seg, np.eye(K), zero_u=True)[2]
    e = states(seg, np.zeros((K, V)))[2]
    check("states map", [p @ s0 + e], [states(seg, s0)[2]])

    # 2. The split states scan against the unsplit one.
    entering, vns, _ = states(chunks, s0)
    maps = [(states(sg, np.eye(K), zero_u=True)[2], states(sg, np.zeros((K, V)))[2])
            for sg in segments]
    got_entering, got_vns = [], []
    for i, sg in enumerate(segments):
        s = s0
        for p_s, e_s in maps[:i]:
            s = p_s @ s + e_s
        ent, vn, _ = states(sg, s)
        got_entering += ent
        got_vns += vn
    check("split states", got_entering, entering)
    check("split v_new", got_vns, vns)

    # The split dstates scan, with its own maps, against the unsplit one.
    leaving, dvs, d0 = dstates(chunks, dfinal)
    dmaps = [(dstates(sg, np.eye(K), zero_dout=True)[2], dstates(sg, np.zeros((K, V)))[2])
             for sg in segments]
    got_leaving, got_dvs, got_d0 = [], [], None
    for i, sg in enumerate(segments):
        ds = dfinal
        for p_s, e_s in reversed(dmaps[i + 1:]):
            ds = p_s @ ds + e_s
        lv, dv, d_entry = dstates(sg, ds)
        got_leaving += lv
        got_dvs += dv
        if i == 0:
            got_d0 = d_entry
    check("split dS'", got_leaving, leaving)
    check("split dv_new", got_dvs, dvs)
    check("split initial-state gradient", [got_d0], [d0])

    # 3. The gradient's map is the transpose of the states' P.
    check("gradient map = P^T", [dm[0] for dm in dmaps], [m[0].T for m in maps])


if __name__ == "__main__":
    main()
