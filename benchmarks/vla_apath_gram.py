"""A design tried for VLA's A path (kalmix/ops/vla/README.md, "A parallel A path"), not used by the op: the
chunk-start states from prefix Gram sums, M_c = A_0⁻¹ + Σ_{earlier chunks} Uᵀ U and A_c = M_c⁻¹, all chunks at
once through torch's batched Cholesky, then each chunk's Woodbury step. Checks it against the sequential chunk
path (fp64 and fp32, spread and concentrated penalty directions; on a GPU also the kernels in use), and on a GPU
times both and torch's batched factorisations. From the repository root:

    python benchmarks/vla_apath_gram.py
"""
import torch
import torch.nn.functional as F

from kalmix.ops.vla.chunk import write_directions


def gram_directions(kh, uh, A, C=64, mode="inv"):
    """α̂ [B, T, H, K] and the final A like ``write_directions``; ``mode`` "inv" forms A_c = M_c⁻¹, "white" works
    in the coordinates of M_c's Cholesky factor L (two triangular solves instead of the inverse)."""
    B, T, H, K = kh.shape
    NC = -(-T // C)
    pad = NC * C - T
    Kc, Uc = (F.pad(x, (0, 0, 0, 0, 0, pad)).view(B, NC, C, H, K).permute(0, 3, 1, 2, 4) for x in (kh, uh))
    M0 = torch.cholesky_inverse(torch.linalg.cholesky(A))
    P = Uc.mT @ Uc
    Pc = P.cumsum(2)
    M = M0[:, :, None] + Pc - P
    L = torch.linalg.cholesky(M)
    eye = torch.eye(C, dtype=kh.dtype, device=kh.device)
    if mode == "inv":
        Ac = torch.cholesky_inverse(L)
        UA = Uc @ Ac
        G = UA @ Uc.mT
        G = eye + G.tril() + G.tril(-1).mT
        R = torch.linalg.cholesky(G)
        W = torch.linalg.solve_triangular(R, UA, upper=False)
        a = Kc @ Ac - (Kc @ W.mT).tril() @ W
    else:   # whitened: Ut = L^-1 U^T, Kt = L^-1 K^T; a = (Kt^T - tril(Kt^T Wt^T) Wt) L^-1
        X = torch.linalg.solve_triangular(L, torch.cat([Uc, Kc], 3).mT, upper=False)   # [.., K, 2C]
        Ut, Kt = X[..., :C], X[..., C:]
        G = Ut.mT @ Ut
        G = eye + G.tril() + G.tril(-1).mT
        R = torch.linalg.cholesky(G)
        Wt = torch.linalg.solve_triangular(R, Ut.mT, upper=False)                        # [.., C, K]
        at = Kt.mT - (Kt.mT @ Wt.mT).tril() @ Wt
        a = torch.linalg.solve_triangular(L.mT, at.mT, upper=True).mT
    alpha = F.normalize(a, dim=-1).permute(0, 2, 3, 1, 4).reshape(B, NC * C, H, K)[:, :T]
    AT = torch.cholesky_inverse(torch.linalg.cholesky(M0 + Pc[:, :, -1]))
    return alpha, AT


def inputs(B, T, H, K, dtype, dev, lam=0.1, seed=0, lowrank=None):
    """Unit keys, unit penalty directions (``lowrank``: concentrated on that many directions) and A_0 = I/lam."""
    g = torch.Generator().manual_seed(seed)
    kh = F.normalize(torch.randn(B, T, H, K, generator=g, dtype=torch.float64), dim=-1)
    u = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    if lowrank:   # directions concentrated: a few strong components plus small noise
        basis = torch.randn(lowrank, K, generator=g, dtype=torch.float64)
        u = torch.randn(B, T, H, lowrank, generator=g, dtype=torch.float64) @ basis + 0.05 * u
    uh = F.normalize(u, dim=-1)
    A0 = torch.eye(K, dtype=torch.float64).expand(B, H, K, K) / lam
    return [x.to(dev, dtype).contiguous() for x in (kh, uh, A0)]


def grads(f, xs):
    """α̂, the final A and the gradients of a fixed random functional of both (dA_0 symmetrised)."""
    xs = [x.detach().clone().requires_grad_() for x in xs]
    al, AT = f(*xs)
    g = torch.Generator().manual_seed(5)
    w1 = torch.randn(al.shape, generator=g, dtype=torch.float64).to(al)
    w2 = torch.randn(AT.shape, generator=g, dtype=torch.float64).to(AT)
    ((al * w1).sum() + (AT * w2).sum()).backward()
    dA = xs[2].grad
    return [al.detach(), AT.detach(), xs[0].grad, xs[1].grad, 0.5 * (dA + dA.mT)]


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


if __name__ == "__main__":
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    names = "alpha A_T dk du dA0".split()
    shapes = [(2, 300, 2, 32), (1, 130, 1, 16)] if dev == "cpu" else [(2, 2048, 4, 128)]
    for lr in (None, 4):
        for shp in shapes:
            ref = grads(write_directions, inputs(*shp, torch.float64, dev, lowrank=lr))
            for dt in ((torch.float64, torch.float32) if dev == "cpu" else (torch.float32,)):
                for mode in ("inv", "white"):
                    got = grads(lambda *x: gram_directions(*x, mode=mode), inputs(*shp, dt, dev, lowrank=lr))
                    print(f"{shp} lowrank={lr} {str(dt)[6:]} {mode}:",
                          " ".join(f"{n}={rel(a, b):.1e}" for n, a, b in zip(names, got, ref)))
            if dev == "cuda":
                from kalmix.ops.vla.apath_triton import write_directions_triton
                got = grads(write_directions_triton, inputs(*shp, torch.float32, dev, lowrank=lr))
                print(f"{shp} lowrank={lr} fp32 current triton:",
                      " ".join(f"{n}={rel(a, b):.1e}" for n, a, b in zip(names, got, ref)))
    if dev == "cuda":
        from triton.testing import do_bench
        from kalmix.ops.vla.apath_triton import write_directions_triton
        B, T, H, K = 16, 2048, 8, 128
        xs = [x.requires_grad_(i < 2) for i, x in enumerate(inputs(B, T, H, K, torch.float32, dev))]
        dal = torch.randn_like(xs[0])
        fns = {"triton (now)": write_directions_triton,
               "gram inv": lambda *x: gram_directions(*x, mode="inv"),
               "gram white": lambda *x: gram_directions(*x, mode="white")}
        for name, f in fns.items():
            with torch.no_grad():
                tf = do_bench(lambda: f(*xs))
            tfb = do_bench(lambda: f(*xs)[0].backward(dal))
            torch.cuda.reset_peak_memory_stats()
            f(*xs)[0].backward(dal)
            mem = torch.cuda.max_memory_allocated() / 2**20
            print(f"{name:14s} fwd {tf:7.3f} ms  fwd+bwd {tfb:7.3f} ms  peak {mem:7.0f} MiB")
        # pieces
        M = torch.eye(K, device=dev).expand(B, H, 32, K, K) * 3 + 0.01 * torch.randn(B, H, 32, K, K, device=dev)
        M = M @ M.mT
        for dt in (torch.float32, torch.float64):
            Md = M.to(dt)
            t1 = do_bench(lambda: torch.linalg.cholesky(Md))
            L = torch.linalg.cholesky(Md)
            t2 = do_bench(lambda: torch.cholesky_inverse(L))
            R = torch.randn(B, H, 32, K, 128, device=dev, dtype=dt)
            t3 = do_bench(lambda: torch.linalg.solve_triangular(L, R, upper=False))
            print(f"{str(dt)[6:]} 4096x[128,128]: cholesky {t1:.3f} cholesky_inverse {t2:.3f} "
                  f"solve_triangular(128 rhs) {t3:.3f} ms")
        G = torch.eye(64, device=dev) + 0.01 * torch.randn(B, H, 32, 64, 64, device=dev)
        G = G @ G.mT
        print(f"fp32 4096x[64,64] cholesky {do_bench(lambda: torch.linalg.cholesky(G)):.3f} ms")
