"""Issue 4: how close a TopK training step gets to its floor, the encoder matmul, and to the public trainers.

The variants run in two subprocesses (this project's interpreter, and the benchmark environment with
sparsify and SAELens) on the same synthetic activations (generated from a fixed seed with the same torch
version in both), the same shapes and the same number of steps; each variant's peak memory is measured
from its own baseline, one variant after the other. A step is forward + backward + Adam (torch's fused Adam
kernel for every trainer: torch.optim.Adam(fused=True) for the others, conceptdict.saes.adam.Adam, which calls the
same kernel, for ours; the unfused CPU Adam alone costs several encoder matmuls at L=16384 and would hide every
difference between the trainers). Variants:

  matmul             the encoder matmul alone, x [B, D] @ W_enc [D, L] + b_enc (the floor); every other
                     variant also times it just before each of its steps
                     and reports the median step/matmul ratio of those pairs ("x matmul"), since this
                     machine's speed drifts by tens of percent within a minute
  ours-topk          conceptdict kernels, impl=auto (fused encode + sparse decode)
  ours-batchtopk     the same with BatchTopK selection
  ours-topk-aux      TopK with the AuxK code from the same matmul (10% dead latents, k_aux = D/2)
  ours-torch-topk    impl=torch (portable sparse autograd), to show what "auto" gains
  reference-topk     impl=reference (dense torch autograd)
  train-topk         one step of conceptdict.saes.train (gradient projection, clipping, renorm, bookkeeping)
  train-topk-bf16    the same with precision="bf16" (the encoder matmul in bf16 chooses the latents; values, loss,
                     weights and Adam float32); its floor is still the float32 matmul, so its "x matmul" over
                     train-topk's is the speed-up (train_topk_bf16_tokens_over_float32); "x own" is the step over
                     the bf16 matmul timed just after the float32 one (train_topk_bf16_over_its_bf16_floor), as
                     for the kind-* rows under ``--precision bf16``. The table's first line is the CPU's model
                     name, its AVX2 / AVX-512 / AVX512-BF16 / AMX flags, ATen's capability and whether oneDNN
                     computes bf16 natively, so that every figure says which hardware it came from
  kind-KIND          one step of the kind's training forward from the kind table (saes.KINDS: topk, batchtopk,
                     jumprelu, matryoshka, spade), its loss terms, and saes.training.apply_update (projection,
                     clipping, Adam, renorm): the kinds side by side, same shapes, same step; kind_*_over_topk
                     are the ratios to kind-topk (SpaDE's row also prints its code's mean entries a row, its
                     support, which sets its sparse work: k for the others); ``--precision bf16`` (fp16 on
                     CUDA) runs them with the encoder matmul in that dtype, as ``train --precision`` does
  kind-crosscoder    the same for the crosscoder (2 sources: batches [B, 2*D], W_enc [2*D, L]); its floor is
                     2 encoder matmuls [B, D] @ [D, L], one per source, timed back to back
  kind-transcoder    the same for the transcoder and the skip transcoder: batches of (input, output) pairs
  kind-skip-transcoder [B, 2, D], the loss against the output half; the encoder reads one source, so the
                     floor is 1 encoder matmul (as every SAE row's)
  kind-clt           a cross-layer transcoder over S = CLT_LAYERS layers with L latents per layer (S*L in all; TopK
                     per layer): batches [B, 2S, D] (the S MLP inputs, then their outputs); its floor is S encoder
                     matmuls [B, D] @ [D, L], one per layer, timed back to back; its decoder [S*L, S*D] writes
                     each latent to its own and every later layer (the entries to earlier layers stay zero)
  sparsify           EleutherAI sparsify SparseCoder, fvu loss         (run with --bench-python)
  saelens            SAELens TopKTrainingSAE.training_forward_pass    (run with --bench-python)

Peak memory: CPU, the peak RSS of the timed steps (VmHWM after resetting it through /proc/self/clear_refs
once the warm-up steps have loaded or compiled their code; torch memory is invisible to tracemalloc) minus
the RSS before the model was built; CUDA, torch.cuda.max_memory_allocated minus the memory allocated before
the model. Both include the weights, the Adam state, the gradients and every buffer of the step; a
tiny-shape run first loads every library and kernel, so code is not counted. The budget of issue 4 is
1.3 x (weights + Adam state + one [B, L] pre-activation buffer).

    .venv/bin/python bench/train_step.py                 # D=768 L=16384 k=32 B=4096, CPU
    .venv/bin/python bench/train_step.py --small         # a preset that finishes in about a minute
    .venv/bin/python bench/train_step.py --threads 1 --only kind-topk kind-batchtopk kind-jumprelu kind-matryoshka
    .venv/bin/python bench/train_step.py --only kind-topk kind-crosscoder kind-transcoder kind-skip-transcoder
    .venv/bin/python bench/train_step.py --small --only kind-transcoder kind-clt   # a CLT against S encoder matmuls
    .venv/bin/python bench/train_step.py --device cuda   # the Triton path, same table
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {
    "full": dict(D=768, L=16384, k=32, B=4096, steps=4, warmup=2),
    "small": dict(D=256, L=4096, k=16, B=1024, steps=3, warmup=1),
    "tiny": dict(D=32, L=256, k=8, B=128, steps=2, warmup=1),  # checks that every row runs (bench/gpu.py --dry-run)
}
KIND_VARIANTS = ("kind-topk", "kind-batchtopk", "kind-jumprelu", "kind-matryoshka", "kind-spade")
# kinds that read several sources: name -> (sources in a batch, encoder matmuls of [B, D] @ [D, L] in the floor)
CLT_LAYERS = 2
MULTI_SOURCE = {"kind-crosscoder": (2, 2), "kind-transcoder": (2, 1), "kind-skip-transcoder": (2, 1),
                "kind-clt": (2 * CLT_LAYERS, CLT_LAYERS)}
OURS = ("matmul", "ours-topk", "ours-batchtopk", "ours-topk-aux", "ours-torch-topk", "reference-topk", "train-topk",
        "train-topk-bf16", *KIND_VARIANTS, *MULTI_SOURCE)
OTHERS = ("sparsify", "saelens")


# ------------------------------------------------------------------ worker side (no conceptdict import here)


def synthetic_batches(n: int, B: int, D: int, device: str):
    """n batches [B, D] float32: 16 of 2D random unit atoms per row with |N(0,1)| weights, plus 0.1 noise."""
    import torch

    g = torch.Generator().manual_seed(1234)
    atoms = torch.nn.functional.normalize(torch.randn(2 * D, D, generator=g), dim=1)
    out = []
    for _ in range(n):
        idx = torch.randint(0, 2 * D, (B, 16), generator=g)
        coef = torch.randn(B, 16, generator=g).abs()
        x = torch.nn.functional.embedding_bag(idx, atoms, per_sample_weights=coef, mode="sum")
        out.append((x + 0.1 * torch.randn(B, D, generator=g)).to(device))
    return out


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    """Peak RSS since the last _reset_hwm (VmHWM), or the process peak when it cannot be reset."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def _adam(params):
    import torch

    return torch.optim.Adam(params, lr=1e-4, fused=True)


class _Meter:
    """Step timer and peak-memory meter for one worker. With ``floor`` (a callable on the batch), every
    timed step is paired with the encoder matmul timed just before it (``floors``): the machine's speed
    drifts by tens of percent within a minute, so ratios come from pairs measured seconds apart."""

    def __init__(self, device: str, floor=None, low_floor=None):
        import torch

        self.torch, self.cuda = torch, device.startswith("cuda")
        self.floor, self.low_floor = floor, low_floor
        self.times: list[float] = []
        self.floors: list[float] = []
        self.low_floors: list[float] = []  # with low_floor: the same matmul in bf16 / fp16, timed after the floor
        self.peaks: list[int] = []  # with a floor: the peak of each timed step alone
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = _rss()

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def _now_peak(self) -> int:
        return self.torch.cuda.max_memory_allocated() if self.cuda else _hwm()

    def peak(self) -> int:
        return (max(self.peaks) if self.peaks else self._now_peak()) - self.base

    def end_step(self) -> None:
        """After a timed step (with a floor): record its own peak."""
        if self.floor is not None:
            self.peaks.append(self._now_peak())

    def time_floor(self, x, record: bool) -> None:
        """Time the floor matmul on x, then reset the peak (RSS, or CUDA's allocator peak), so the fresh
        [B, L] output it just freed does not count as the next step's memory."""
        if self.floor is not None:
            for fn, times in ((self.floor, self.floors), (self.low_floor, self.low_floors)):
                if fn is None:
                    continue
                self.sync()
                t = time.perf_counter()
                fn(x)
                self.sync()
                if record:
                    times.append(time.perf_counter() - t)
            if record:
                if self.cuda:
                    self.torch.cuda.reset_peak_memory_stats()
                else:
                    _reset_hwm()

    def run(self, step, batches, warmup: int) -> None:
        for i, x in enumerate(batches):
            if i == warmup and not self.cuda:
                _reset_hwm()
            self.time_floor(x, i >= warmup)
            self.sync()
            t = time.perf_counter()
            step(x)
            self.sync()
            if i >= warmup:
                self.times.append(time.perf_counter() - t)
                self.end_step()


def _init_weights(D: int, L: int, device: str):
    """W_dec unit rows, W_enc = W_dec^T, zero biases (sparsify's and OpenAI's initialisation), seeded.

    W_enc is returned as its latent-major storage [L, D] (SparseCoder's layout; the encoder is its ``.t()``)."""
    import torch

    g = torch.Generator().manual_seed(0)
    W_dec = torch.nn.functional.normalize(torch.randn(L, D, generator=g), dim=1)
    return W_dec.clone().to(device), torch.zeros(L, device=device), W_dec.to(device), torch.zeros(D, device=device)


def _ours(name: str, p: dict, meter: _Meter, batches) -> dict:
    import torch

    from conceptdict.saes import kernels

    impl = {"ours-torch-topk": "torch", "reference-topk": "reference"}.get(name, "auto")
    batch = name == "ours-batchtopk"
    W_enc_t, b_enc, W_dec, b_dec = (t.requires_grad_() for t in _init_weights(p["D"], p["L"], p["device"]))
    opt = _adam([W_enc_t, b_enc, W_dec, b_dec])
    dead, k_aux = None, 0
    if name == "ours-topk-aux":
        dead = torch.zeros(p["L"], dtype=torch.bool, device=p["device"])
        dead[torch.randperm(p["L"], generator=torch.Generator().manual_seed(1))[: p["L"] // 10]] = True
        k_aux = p["D"] // 2

    def step(x):
        total_var = (x - x.mean(0)).pow(2).sum()
        enc = kernels.encode(x - b_dec, W_enc_t.t(), b_enc, p["k"], batch=batch, dead=dead, k_aux=k_aux, impl=impl)
        x_hat = kernels.sparse_decode(enc.values, enc.indices, W_dec, b_dec, impl=impl, skip_zero_grads=True)
        e = x - x_hat
        loss = e.pow(2).sum() / total_var
        if k_aux:
            e_hat = kernels.sparse_decode(enc.aux_values, enc.aux_indices, W_dec, None, impl=impl, skip_zero_grads=True)
            loss = loss + (e.detach() - e_hat).pow(2).sum() / total_var / 32
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    meter.run(step, batches, p["warmup"])
    resolved = kernels.resolve_impl("encode", impl, torch.device(p["device"]))
    return {"impl": resolved}


def kind_step(name: str, p: dict, meter: _Meter, batches) -> dict:
    """One training step of a kind of the kind table (forward, its loss terms, apply_update); the batches of
    a kind of ``MULTI_SOURCE`` hold its sources flattened ([B, S*D]), split as the training loop splits them."""
    import torch

    from conceptdict.saes import SparseCoder, TrainConfig
    from conceptdict.saes.comm import local_inputs
    from conceptdict.saes.config import kind_default
    from conceptdict.saes.precision import MATMUL_DTYPES
    from conceptdict.saes.training import apply_update, make_optimizer

    kind = name.split("-", 1)[1]
    cfg = TrainConfig(latents=p["L"], k=p["k"], kind=kind, precision=p.get("precision", "float32"))
    n_sources = MULTI_SOURCE[name][0] if kind.startswith("crosscoder") else 1
    latents = p["L"]
    if kind == "clt":  # L latents per layer, as many layers as the floor has matmuls
        n_sources = MULTI_SOURCE[name][1]
        latents = p["L"] * n_sources
        cfg = TrainConfig(latents=latents, k=p["k"], kind=kind, precision=p.get("precision", "float32"))
    model = SparseCoder(p["D"], latents, p["k"], kind, n_sources=n_sources).to(p["device"])
    model.reset_parameters(generator=torch.Generator().manual_seed(0))
    model.add_train_params()
    model.to(p["device"])
    if model.spec.init is not None:
        model.spec.init(model, batches[0])
    opt = make_optimizer(model, 1e-4)

    def step(batch):
        x, target = model.split(batch)
        inputs = local_inputs(target)._replace(settings=cfg.kind_settings, code_l1=kind_default(cfg, "code_l1"),
                                               matmul_dtype=MATMUL_DTYPES[cfg.precision])
        out = model.spec.train_forward(model, x, inputs)
        loss = (target - out.x_hat).pow(2).sum() / inputs.stats.total_var
        if out.sparsity_loss is not None:
            loss = loss + out.sparsity_loss
        apply_update(model, opt, loss, 1e-4, 1.0)
        if kind == "spade":  # (SpaDE's step synchronises already: its code's width is read on the host)
            l0.append(float(out.l0))

    l0: list[float] = []
    meter.run(step, batches, p["warmup"])
    extra = {"entries_per_row": statistics.mean(l0)} if kind == "spade" else {}  # its code's size is its own
    return {"impl": kernels_impl(p["device"]), "latents": model.n_latents, "n_sources": model.n_sources, **extra}


def kernels_impl(device: str) -> str:
    import torch

    from conceptdict.saes import kernels

    return kernels.resolve_impl("encode", "auto", torch.device(device))


def _matmul(p: dict, meter: _Meter, batches) -> dict:
    import torch

    W_enc_t, b_enc, _, _ = _init_weights(p["D"], p["L"], p["device"])
    W_enc = W_enc_t.t()
    meter.run(lambda x: torch.addmm(b_enc, x, W_enc), batches, p["warmup"])
    buf = torch.empty(p["B"], p["L"], device=p["device"])
    inner = _Meter(p["device"])
    inner.run(lambda x: torch.addmm(b_enc, x, W_enc, out=buf), batches, p["warmup"])
    return {"into_buffer_s": statistics.median(inner.times)}


def _train(p: dict, meter: _Meter, batches, precision: str = "float32") -> dict:
    from conceptdict.saes.training import TrainConfig, train

    stamps: list[float] = []

    def stream():
        for i, x in enumerate(batches):
            meter.sync()
            if i == 1 + p["warmup"] and not meter.cuda:
                _reset_hwm()  # after the initialisation (b_dec, scale) and the warm-up steps
            stamps.append(time.perf_counter())
            if i > 1 + p["warmup"]:
                meter.end_step()  # the step on batch i - 1 just ended
            meter.time_floor(x, i >= 1 + p["warmup"])  # paired with the step on batch i, timed from after it
            stamps.append(time.perf_counter())
            yield x
        meter.sync()
        stamps.append(time.perf_counter())

    cfg = TrainConfig(latents=p["L"], k=p["k"], batch_size=p["B"], tokens=p["B"] * (len(batches) - 1),
                      eval_batches=0, init_rows=p["B"], checkpoint_every=0, log_every=10**9, device=p["device"],
                      precision=precision)
    train(cfg, stream())
    # stamps: before and after each batch's floor matmul, then the end; step i runs from after floor i to
    # before floor i + 1
    gaps = [b - a for a, b in zip(stamps[1::2], stamps[2::2])]
    meter.times = gaps[1 + p["warmup"]:] or gaps[-1:]
    return {}


def _sparsify(p: dict, meter: _Meter, batches) -> dict:
    import torch
    from sparsify import SparseCoder, SparseCoderConfig

    torch.manual_seed(0)
    sae = SparseCoder(p["D"], SparseCoderConfig(num_latents=p["L"], k=p["k"]), device=p["device"])
    opt = _adam(sae.parameters())

    def step(x):
        out = sae(x)
        opt.zero_grad(set_to_none=True)
        out.fvu.backward()
        opt.step()

    meter.run(step, batches, p["warmup"])
    return {}


def _saelens(p: dict, meter: _Meter, batches) -> dict:
    import torch
    from sae_lens import TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.saes.sae import TrainStepInput

    torch.manual_seed(0)
    sae = TopKTrainingSAE(TopKTrainingSAEConfig(d_in=p["D"], d_sae=p["L"], k=p["k"], device=p["device"]))
    opt = _adam(sae.parameters())
    n = [0]

    def step(x):
        out = sae.training_forward_pass(TrainStepInput(x, {}, None, n[0], False))
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        n[0] += 1

    meter.run(step, batches, p["warmup"])
    return {}


def worker(names: list[str], p: dict) -> None:
    """Run each variant once at a tiny shape (loads and compiles code), then measure it at ``p``;
    prints one RESULT line per variant. conceptdict is imported before torch, as in a user's process, so
    its OpenMP wait policy (api/__init__.py) holds for our variants; OMP_WAIT_POLICY=ACTIVE overrides it."""
    if set(names) & set(OURS):
        import conceptdict  # noqa: F401

        print("TORCH_CPU " + json.dumps(torch_cpu()), flush=True)
    for name in names:
        try:
            _measure(name, dict(p, D=16, L=64, k=4, B=32, steps=1, warmup=1))
            r = _measure(name, p)
        except Exception as exc:  # report and go on with the next variant
            r = {"name": name, "error": f"{type(exc).__name__}: {exc}"[:300]}
        print("RESULT " + json.dumps(r), flush=True)


def _measure(name: str, p: dict) -> dict:
    import torch

    torch.manual_seed(0)
    numba_impl = sys.modules.get("conceptdict.saes.kernels.numba_impl")
    if numba_impl is not None:  # buffers an earlier variant left for reuse would hide from this one's peak
        numba_impl.release_buffers()
    sources, matmuls = MULTI_SOURCE.get(name, (1, 1))
    batches = synthetic_batches(p["warmup"] + p["steps"], p["B"], sources * p["D"], p["device"])
    floor = _floor(p, matmuls) if name != "matmul" else None
    low = low_precision(name, p)
    meter = _Meter(p["device"], floor, _floor(p, matmuls, low) if floor and low else None)
    if name == "matmul":
        extra = _matmul(p, meter, batches)
    elif name in ("train-topk", "train-topk-bf16"):
        extra = _train(p, meter, batches + batches[:1], "bf16" if name.endswith("bf16") else "float32")
    elif name.startswith("kind-"):
        extra = kind_step(name, p, meter, batches)
    elif name == "sparsify":
        extra = _sparsify(p, meter, batches)
    elif name == "saelens":
        extra = _saelens(p, meter, batches)
    else:
        extra = _ours(name, p, meter, batches)
    step_s = statistics.median(meter.times)
    own = {}
    if meter.low_floors:  # the step over the matmul in its own precision, timed just before it
        own = {"precision": low, "low_floor_s": statistics.median(meter.low_floors),
               "step_over_own_floor": statistics.median(t / f for t, f in zip(meter.times, meter.low_floors))}
    return {"name": name, "step_s": step_s, "tokens_per_s": p["B"] / step_s, "peak_bytes": meter.peak(),
            "times": meter.times, "floor_matmuls": matmuls, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "floor_s": statistics.median(meter.floors) if floor else step_s,
            "step_over_floor": (statistics.median(t / f for t, f in zip(meter.times, meter.floors))
                                if floor else 1.0), **own, **extra}


def low_precision(name: str, p: dict) -> str | None:
    """The precision below float32 a row trains in (its encoder matmul): bf16 for train-topk-bf16, ``--precision``
    for the kind-* rows; None for float32 rows."""
    if name == "train-topk-bf16":
        return "bf16"
    if name.startswith("kind-") and p.get("precision", "float32") in ("bf16", "fp16"):
        return p["precision"]
    return None


def _floor(p: dict, matmuls: int = 1, precision: str | None = None):
    """The encoder matmul x @ W_enc + b_enc timed before every step of a variant (``_Meter``; the peak
    memory of each step is measured after it): with a fresh output, as the "matmul" variant, or with
    ``floor="buffer"`` into a preallocated, already-touched output. ``matmuls`` > 1 (a crosscoder's S
    sources): that many [B, D] @ [D, L] products back to back, source s read from columns s*D..(s+1)*D of x.
    ``precision`` bf16 / fp16: the matmul in that dtype (weights cast once, x cast inside, as a step casts it)."""
    import torch

    W_enc_t, b_enc, _, _ = _init_weights(p["D"], p["L"], p["device"])
    W_enc, D = W_enc_t.t(), p["D"]
    if precision is not None:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        W_enc, b_enc = W_enc.to(dtype), b_enc.to(dtype)
        cast = (lambda fn: lambda x: fn(x.to(dtype)))
        if matmuls == 1:
            return cast(lambda x: torch.addmm(b_enc, x[:, :D], W_enc))
        return cast(lambda x: [torch.addmm(b_enc, x[:, s * D:(s + 1) * D], W_enc) for s in range(matmuls)])
    if p.get("floor", "fresh") == "buffer":
        out = torch.zeros(p["B"], p["L"], device=p["device"]).fill_(0.0)  # touched: counted before the baseline

        def one(x):
            return torch.addmm(b_enc, x, W_enc, out=out)
    else:
        def one(x):
            return torch.addmm(b_enc, x, W_enc)
    if matmuls == 1:
        return lambda x: one(x[:, :D])
    return lambda x: [one(x[:, s * D:(s + 1) * D]) for s in range(matmuls)]


# ------------------------------------------------------------------ parent side


def run_worker(python: str, names: list[str], p: dict, timeout: float) -> dict[str, dict]:
    """Run the variants ``names`` in one subprocess of ``python``; name -> result (or {"error": ...})."""
    cmd = [python, str(Path(__file__).resolve()), "--worker", ",".join(names), "--params", json.dumps(p)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if p.get("threads"):  # torch (OpenMP) and numba read these when the worker imports them
        env.update(OMP_NUM_THREADS=str(p["threads"]), NUMBA_NUM_THREADS=str(p["threads"]))
    out: dict[str, dict] = {}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) as proc:
        deadline = time.monotonic() + timeout
        for line in proc.stdout:
            if line.startswith("TORCH_CPU "):
                p["torch_cpu"] = json.loads(line[len("TORCH_CPU "):])
            if line.startswith("RESULT "):
                r = json.loads(line[len("RESULT "):])
                out[r["name"]] = r
                print(f"  {r['name']}: " + (r.get("error") or f"{1e3 * r['step_s']:.1f} ms/step"), flush=True)
            if time.monotonic() > deadline:
                proc.kill()
                break
        err = proc.stderr.read().strip().splitlines()[-3:]
    for name in names:
        out.setdefault(name, {"name": name, "error": " | ".join(err) or "no result (timed out?)"})
    return out


def budget_bytes(p: dict) -> dict:
    n_weights = 2 * p["D"] * p["L"] + p["L"] + p["D"]
    return {"weights": 4 * n_weights, "adam": 8 * n_weights, "pre_buffer": 4 * p["B"] * p["L"]}


def ratios(res: dict, p: dict) -> dict:
    def step(n):
        return res.get(n, {}).get("step_s")

    def ratio(a, b):
        return a / b if a and b else None

    def rel(n):  # step in units of the matmul timed just before each step (median of the pairs)
        return res.get(n, {}).get("step_over_floor")

    budget = sum(budget_bytes(p).values())
    ours_peak = res.get("ours-topk", {}).get("peak_bytes")
    return {
        "ours_step_over_matmul (goal <= 1.5)": rel("ours-topk"),
        "ours_step_over_matmul_variant": ratio(step("ours-topk"), step("matmul")),
        "ours_tokens_over_sparsify (goal >= 1.5)": ratio(rel("sparsify"), rel("ours-topk")),
        "ours_tokens_over_sparsify_raw": ratio(step("sparsify"), step("ours-topk")),
        "ours_tokens_over_saelens (goal >= 3)": ratio(rel("saelens"), rel("ours-topk")),
        "ours_tokens_over_saelens_raw": ratio(step("saelens"), step("ours-topk")),
        "batchtopk_over_topk (goal <= 1.2)": ratio(rel("ours-batchtopk"), rel("ours-topk")),
        "ours_peak_over_budget (goal <= 1.3)": ratio(ours_peak, budget),
        "topk_aux_over_topk": ratio(rel("ours-topk-aux"), rel("ours-topk")),
        **{f"kind_{n[5:]}_over_topk" + (" (goal <= 1.3)" if n[5:] in ("batchtopk", "jumprelu", "matryoshka") else ""):
           ratio(rel(n), rel("kind-topk")) for n in KIND_VARIANTS[1:]},
        **{f"{n[5:].replace('-', '_')}_over_its_floor (goal <= 1.5)": rel(n) for n in MULTI_SOURCE},
        "reference_over_ours": ratio(rel("reference-topk"), rel("ours-topk")),
        "torch_impl_over_ours": ratio(rel("ours-torch-topk"), rel("ours-topk")),
        "train_step_over_ours": ratio(rel("train-topk"), rel("ours-topk")),
        "train_topk_over_its_floor (goal <= 1.3)": rel("train-topk"),
        "train_topk_bf16_over_its_bf16_floor (goal <= 1.5)": res.get("train-topk-bf16", {}).get("step_over_own_floor"),
        "train_topk_bf16_tokens_over_float32 (goal >= 1.6)": ratio(rel("train-topk"), rel("train-topk-bf16")),
        "train_topk_bf16_tokens_over_float32_raw": ratio(step("train-topk"), step("train-topk-bf16")),
        "sparsify_over_reference": ratio(rel("sparsify"), rel("reference-topk")),
        "saelens_over_reference": ratio(rel("saelens"), rel("reference-topk")),
    }


CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
"""The CPU flags that decide the speed of a float32 and a bf16 matmul (oneDNN: AVX512-BF16 or AMX make bf16 native)."""


def cpu_info() -> dict:
    """The CPU's model name and which of :data:`CPU_FLAGS` it has (/proc/cpuinfo; empty where there is none)."""
    info: dict = {"model": None, "flags": []}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and info["model"] is None:
                    info["model"] = value.strip()
                elif key.strip() == "flags":
                    have = set(value.split())
                    info["flags"] = [f for f in CPU_FLAGS if f in have]
                    break
    except OSError:
        pass
    return info


def torch_cpu() -> dict:
    """What torch makes of this CPU (asked in the worker, which imports torch): ATen's vector capability and
    whether oneDNN multiplies bf16 natively (conceptdict's ``precision auto`` reads the same)."""
    import torch

    from conceptdict.saes.precision import native_bf16

    return {"aten_capability": torch.backends.cpu.get_cpu_capability(), "native_bf16_cpu": native_bf16(torch.device("cpu"))}


def print_table(res: dict, rat: dict, p: dict) -> None:
    cpu = p.get("cpu", {})
    print(f"CPU {cpu.get('model')} | flags {' '.join(cpu.get('flags', [])) or '-'} | "
          + " | ".join(f"{k} {v}" for k, v in p.get("torch_cpu", {}).items()))
    print(f"D={p['D']} L={p['L']} k={p['k']} B={p['B']} device={p['device']} precision(kind-*)={p.get('precision')} "
          f"steps={p['steps']} (+{p['warmup']} warm-up)"
          f" floor={p.get('floor', 'fresh')}")
    print("x matmul: median over steps of the step over the encoder matmul timed just before it")
    print("x own: the same over the matmul in the row's own precision (bf16 / fp16 rows), timed just after it")
    print(f"{'variant':18s} {'step ms':>9s} {'matmul ms':>9s} {'x matmul':>9s} {'x own':>6s} {'tokens/s':>10s} "
          f"{'peak MiB':>9s}  impl")
    for name, r in res.items():
        if "error" in r:
            print(f"{name:18s} error: {r['error']}")
            continue
        own = f"{r['step_over_own_floor']:6.2f}" if "step_over_own_floor" in r else f"{'-':>6s}"
        print(f"{name:18s} {1e3 * r['step_s']:9.1f} {1e3 * r['floor_s']:9.1f} {r['step_over_floor']:9.2f} {own} "
              f"{r['tokens_per_s']:10.0f} {r['peak_bytes'] / 2**20:9.1f}  {r.get('impl', '')}"
              + (f" (floor: {r['floor_matmuls']} matmuls)" if r.get("floor_matmuls", 1) > 1 else "")
              + (f" (code: {r['entries_per_row']:.0f} entries a row)" if "entries_per_row" in r else ""))
    b = budget_bytes(p)
    print("memory budget (MiB): " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in b.items())
          + f"; x1.3 = {1.3 * sum(b.values()) / 2**20:.1f}")
    for k, v in rat.items():
        print(f"  {k:42s} {'n/a' if v is None else f'{v:.2f}'}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="small preset (about a minute on 2 cores)")
    ap.add_argument("--tiny", action="store_true", help="tiny preset: checks that the rows run, measures nothing")
    ap.add_argument("--precision", default="float32", choices=("float32", "bf16", "fp16"),
                    help="the encoder matmul's precision in the kind-* rows (train-topk-bf16 is always bf16)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the Triton path on CUDA)")
    ap.add_argument("--steps", type=int, help="timed steps per variant (median reported)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (numba/triton compilation, torch.compile)")
    ap.add_argument("--only", nargs="*", help="run only these variants")
    ap.add_argument("--floor", choices=("fresh", "buffer"), default="fresh",
                    help="the matmul each step is paired with: x @ W_enc + b_enc with a fresh output (default, as a "
                         "user writes it) or into a preallocated output (the pure compute, ~20%% faster on CPU)")
    ap.add_argument("--bench-python", default=str(ROOT / ".venv-bench" / "bin" / "python"),
                    help="interpreter with eai-sparsify and sae-lens installed (skipped when missing)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per environment")
    ap.add_argument("--threads", type=int, help="CPU threads of torch and numba in the workers (default: theirs); "
                    "1 gives repeatable ratios on a shared machine")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--params", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker.split(","), json.loads(a.params))
        return
    preset = "tiny" if a.tiny else "small" if a.small else "full"
    p = dict(PRESETS[preset], device=a.device, floor=a.floor, threads=a.threads, precision=a.precision,
             cpu=cpu_info())
    p.update({k: v for k, v in (("steps", a.steps), ("warmup", a.warmup)) if v is not None})
    names = [n for n in OURS + OTHERS if not a.only or n in a.only]
    res = run_worker(sys.executable, [n for n in names if n in OURS], p, a.timeout) if set(names) & set(OURS) else {}
    others = [n for n in names if n in OTHERS]
    if others and not Path(a.bench_python).exists():
        res.update({n: {"name": n, "error": f"no benchmark interpreter at {a.bench_python}"} for n in others})
    elif others:
        res.update(run_worker(a.bench_python, others, p, a.timeout))
    rat = ratios(res, p)
    print_table(res, rat, p)
    if a.json:
        a.json.write_text(json.dumps({"params": p, "results": res, "ratios": rat,
                                      "budget_bytes": budget_bytes(p)}, indent=2))


if __name__ == "__main__":
    main()
