"""Probe (GPU machine, torch): bf16 [4, 4096, 32, 128] bshd views of a
[4, 32, 4096, 128] bhsd tensor, out of place. Which memory order does
torch.compile give its new output, and how fast are it and cupy-rope with
each output order, against a same-run copy of the same bytes?

    PYTHONPATH=. python3 scripts/probe_strided.py

Results: docs/perf-notes.md (v10)."""
import statistics

import torch

import cupy_rope


def time_us(fn, reps=30):
    for _ in range(5):
        fn()
    torch.cuda._sleep(50_000_000)  # queue the timed calls behind a spinning kernel
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev) * 1e3


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), -1)


def main():
    b, s, h, d = 4, 4096, 32, 128
    dev = "cuda"
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d)
    th = torch.arange(s, device=dev, dtype=torch.float32)[:, None] * inv
    cos, sin = th.cos(), th.sin()
    cos_full = torch.cat([cos, cos], -1).bfloat16().view(1, s, 1, d)
    sin_full = torch.cat([sin, sin], -1).bfloat16().view(1, s, 1, d)
    views = [torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16).transpose(1, 2)
             for _ in range(3)]
    contiguous = [torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    out_contiguous = [torch.empty_like(x) for x in contiguous]
    out_like_views = [torch.empty_like(x) for x in views]  # keeps the bhsd memory order
    src = torch.empty(b * s * h * d, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    compiled = torch.compile(lambda x, c, s_: x * c + rotate_half(x) * s_)
    print("torch.compile's output strides, view in:",
          compiled(views[0], cos_full, sin_full).stride(),
          "contiguous in:", compiled(contiguous[0], cos_full, sin_full).stride())
    y = cupy_rope.apply_rope(views[0], cos, sin)
    want = views[0].float() * cos_full.float() + rotate_half(views[0].float()) * sin_full.float()
    print("cupy-rope's new output strides:", y.stride(),
          "max |error|:", float((y.float() - want).abs().max()))
    turn = iter(range(1 << 40))

    def pick():
        return next(turn) % 3

    rows = [("copy", time_us(lambda: dst.copy_(src))),
            ("compile, view in (new output)",
             time_us(lambda: compiled(views[pick()], cos_full, sin_full))),
            ("compile, contiguous in (new output)",
             time_us(lambda: compiled(contiguous[pick()], cos_full, sin_full)))]
    for name, xs, outs in (("view in, contiguous out=", views, out_contiguous),
                           ("view in, out= in x's order", views, out_like_views),
                           ("contiguous in, out=", contiguous, out_contiguous)):
        def call(xs=xs, outs=outs):
            i = pick()
            cupy_rope.apply_rope(xs[i], cos, sin, out=outs[i])
        rows.append((f"cupy-rope, {name}", time_us(call)))
    rows.append(("cupy-rope, view in (new output)",
                 time_us(lambda: cupy_rope.apply_rope(views[pick()], cos, sin))))
    copy = rows[0][1]
    for name, t in rows:
        print(f"{name:40s} {t:8.1f} us {copy / t:6.3f} of copy")


if __name__ == "__main__":
    main()
